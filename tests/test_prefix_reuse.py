"""Rows that remember: the cut-back rule, where a request goes, and that reusing a row changes no
token or logprob (float32, past the window too)."""

from __future__ import annotations

import random

import pytest
import torch

from mixtral_infer import Tokenizer, load_model
from mixtral_infer.generation.text_stream import TextStream
from mixtral_infer.serve.engine import Engine, Finished, RequestSettings, TokenEvent
from mixtral_infer.serve import prefix_reuse
from mixtral_infer.serve.prefix_reuse import (
    MIN_REUSED_TOKENS,
    Answer,
    Placement,
    RowState,
    answer_length,
    can_cut_back,
    kept_answers,
    reusable_length,
    with_generated_answer,
)
from mixtral_infer.errors import GenerationError
from mixtral_infer.model.cache import BufferKind, RotatingBufferCache, SlackSlots, copied_slots
from mixtral_infer.serve.protocol import chat_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

W = 4
ONE = [BufferKind(W, W)]  # every layer: W slots, window W


# ---- the rule ------------------------------------------------------------------------------


def test_cut_back_table_of_the_docstring():
    """S = W = 4: rows that have seen 3, 4 and 5 tokens."""
    assert [m for m in range(6) if can_cut_back(3, m, W, W)] == [0, 1, 2, 3]
    assert [m for m in range(6) if can_cut_back(4, m, W, W)] == [0, 1, 2, 3, 4]  # m = W
    assert [m for m in range(7) if can_cut_back(5, m, W, W)] == [5]  # wrapped: m = W + 1 only at its end
    assert [m for m in range(12) if can_cut_back(11, m, W, W)] == [11]


def test_cut_back_with_spare_slots_and_without_a_window():
    """A row of W + s slots steps back s tokens once it has wrapped; without a window any prefix is kept."""
    assert [m for m in range(10) if can_cut_back(9, m, 6, 4)] == [7, 8, 9]  # s = 2
    assert [m for m in range(10) if can_cut_back(6, m, 6, 4)] == list(range(7))  # not wrapped
    assert all(can_cut_back(100, m, 100, None) for m in range(101))
    assert not can_cut_back(3, 4, W, W)  # never past what the row has seen


def test_reusable_length_docstring_example_and_boundaries():
    assert reusable_length([1, 5, 6, 7, 8], [1, 5, 6, 7, 8, 9], ONE) == 5
    assert reusable_length([1, 5, 6, 7, 8], [1, 5, 6, 7, 2], ONE) == 0
    held = [1, 5, 6, 7]  # h = W: never wrapped
    assert reusable_length(held, [1, 5, 6, 7, 9], ONE) == 4  # m = W
    assert reusable_length(held, [1, 5, 6, 2, 9], ONE) == 3
    assert reusable_length(held, [1, 5, 6, 7], ONE) == 3  # the last prompt token is always fed
    assert reusable_length(held + [8], [1, 5, 6, 7, 8], ONE) == 0  # wrapped, m = W would be a cut back
    assert reusable_length(held + [8], held + [8, 3], ONE) == 5  # m = W + 1 at the wrapped row's end
    assert reusable_length([], [1, 2], ONE) == 0
    assert reusable_length([2, 3], [1, 2, 3], ONE) == 0


def test_copied_slots():
    assert copied_slots(3, W) == slice(0, 3)
    assert copied_slots(W, W) == slice(0, W)
    assert copied_slots(W + 1, W) is None  # wrapped: the whole row


def test_reusable_length_is_the_rule_in_every_kind_of_layer():
    """Ministral's layers: full attention (64 slots, never wrapped) beside windowed ones (W slots).
    The windowed layers decide; a model of full-attention layers only cuts back anywhere."""
    mixed = [BufferKind(64, None), BufferKind(W, W)]
    held = [1, 5, 6, 7, 8]  # wrapped in the windowed layers
    assert reusable_length(held, held + [9], mixed) == 5  # at its end
    assert reusable_length(held, [1, 5, 6, 7, 2], mixed) == 0  # a cut back the windowed layers cannot make
    assert reusable_length(held, [1, 5, 6, 7, 2], [BufferKind(64, None)]) == 4
    assert reusable_length(held[:3], [1, 5, 2], mixed) == 2  # never wrapped: any prefix


def test_the_docstring_examples_hold():
    """prefix_reuse's (can_cut_back, answer_length, kept_answers ...) and the cache's (slack_writes ...)."""
    import doctest

    from mixtral_infer.model import cache

    for module in (prefix_reuse, cache):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_cut_back_with_slack_table_of_the_docstring():
    """S = W = 4, slack 2: the module docstring's table, row by row (seen, saved) -> lengths it serves."""
    table = {(3, 0): range(0, 4), (4, 0): range(0, 5), (5, 0): [5], (5, 1): range(0, 6), (7, 2): [5, 6, 7]}
    for (seen, saved), served in table.items():
        assert [m for m in range(9) if can_cut_back(seen, m, W, W, saved)] == list(served), (seen, saved)


def test_reusable_length_counts_what_each_kind_of_layer_saved():
    """reusable_length's docstring (position 0 saved), and the module docstring's per-layer example:
    layers [full (64 slots), W = 4], a row at h = 7 whose windowed layers saved 2 positions."""
    assert reusable_length([1, 5, 6, 7, 8], [1, 5, 6, 7, 2], ONE, saved=[1]) == 4
    mixed = [BufferKind(64, None), BufferKind(W, W)]
    held = [1, 5, 6, 7, 8, 9, 10]
    served = [m for m in range(1, 8) if reusable_length(held, held[:m] + [99], mixed, saved=[0, 2]) == m]
    assert served == [5, 6, 7]
    assert reusable_length(held, held[:4] + [99], mixed, saved=[0, 2]) == 0  # the windowed layers lack p0
    assert reusable_length(held, held[:4] + [99], [BufferKind(64, None)], saved=[0]) == 4


# ---- slack slots: what a wrapped row keeps, and how it steps back ----------------------------


def positions_cache(slack, sizes=(W,), windows=(W,), rows=1):
    """A cache whose keys and values are the positions they stand for (one head of one number),
    with SlackSlots beside it."""
    cache = RotatingBufferCache(len(sizes), rows, list(sizes), 1, 1, list(windows))
    cache.start_sequences(rows)
    return cache, SlackSlots(cache, slack)


def feed(cache, slack, row, n, in_pass=True):
    """Feed ``row`` n tokens as a pass does: the slack keeps what they push out, then each layer writes
    positions seen .. seen + n - 1 (the last S of them) into slots p % S: through the cache's views as
    ``Transformer.forward`` does (``in_pass``: the chunk's own pushed-out positions go to the slack),
    or by hand as the static steps do."""
    lengths = [0] * cache.max_batch_size
    lengths[row] = n
    slack.save(lengths, in_pass=in_pass)
    seen = cache.tokens_seen[row]
    if in_pass:
        metadata = cache.get_input_metadata(lengths)
        positions = torch.arange(seen, seen + n, dtype=torch.float32)[:, None, None]  # (T, H_kv, Dh)
        for layer in range(cache.n_layers):
            cache.get_view(layer, metadata).update(positions, -positions)
        cache.advance(lengths)
        return
    for index, kind in enumerate(cache.kinds):
        for p in range(max(seen, seen + n - kind.size), seen + n):
            cache.kind_k[index][:, row, p % kind.size] = float(p)
            cache.kind_v[index][:, row, p % kind.size] = float(-p)
    cache.tokens_seen[row] += n


def slots(tensor, row=0):
    return [int(x) for x in tensor[0, row, :, 0, 0].tolist()]


def test_slack_slots_docstring_example():
    """S = 4, slack 3: a row reads positions 0..3 and decodes 4, 5, 6; cut back to 5, then to 4."""
    cache, slack = positions_cache(3)
    feed(cache, slack, 0, 4)
    for _ in range(3):
        feed(cache, slack, 0, 1)
    assert slots(cache.kind_k[0]) == [4, 5, 6, 3] and slots(slack.keys[0]) == [0, 1, 2] and slack.saved[0] == [3]
    slack.cut_back(0, 5)
    assert slots(cache.kind_k[0]) == [4, 1, 2, 3] and slots(cache.kind_v[0]) == [-4, -1, -2, -3]
    assert cache.tokens_seen == [5] and slack.saved[0] == [1]
    assert can_cut_back(5, 4, W, W, slack.saved[0][0])
    slack.cut_back(0, 4)
    assert slots(cache.kind_k[0]) == [0, 1, 2, 3] and slack.saved[0] == [0]
    feed(cache, slack, 0, 1)  # going on from the cut: position 4 pushes out position 0 again
    assert slots(cache.kind_k[0]) == [4, 1, 2, 3] and slack.saved[0] == [1]


def test_a_chunk_longer_than_the_buffer_keeps_what_it_pushes_out_only_through_the_views():
    """A chunk of 7 on S = 4 pushes out positions 0..2 of its own: the views write them to the slack
    (Transformer.forward); a pass that writes the buffers by hand (the static steps) keeps none, and
    a cut back the slack cannot serve is refused."""
    cache, slack = positions_cache(3)
    feed(cache, slack, 0, 7)
    assert slack.saved[0] == [3] and slots(slack.keys[0]) == [0, 1, 2] and slots(slack.values[0]) == [0, -1, -2]
    slack.cut_back(0, 5)
    assert slots(cache.kind_k[0]) == [4, 1, 2, 3]
    cache, slack = positions_cache(3)
    feed(cache, slack, 0, 7, in_pass=False)
    assert slack.saved[0] == [0]
    with pytest.raises(GenerationError, match="keeps positions from 3 on"):
        slack.cut_back(0, 6)
    feed(cache, slack, 0, 2, in_pass=False)  # a chunk within S: positions 3, 4 pushed out and kept
    assert slack.saved[0] == [2]
    slack.cut_back(0, 7)
    assert slots(cache.kind_k[0]) == [4, 5, 6, 3]
    slack.cut_back(0, 0)  # a new sequence: nothing needed, nothing kept
    assert cache.tokens_seen == [0] and slack.saved[0] == [0]


def test_slack_copies_a_cut_back_row_and_leaves_its_source():
    """Two kinds, a full-attention layer (16 slots) and a windowed one (W): a row at 9 tokens copied
    to another at 7 gets the windowed positions 3..6 back from the slack; the source is unchanged."""
    cache, slack = positions_cache(3, sizes=(16, W), windows=(None, W), rows=2)
    feed(cache, slack, 0, 5)
    for _ in range(4):
        feed(cache, slack, 0, 1)
    assert slack.saved[0] == [0, 3]  # the full-attention layer never pushes anything out
    slack.copy_row(0, 1, 7)
    assert slots(cache.kind_k[1], row=1) == [4, 5, 6, 3] and slots(cache.kind_k[1], row=0) == [8, 5, 6, 7]
    assert slots(cache.kind_k[0], row=1)[:7] == list(range(7))
    assert cache.tokens_seen == [9, 7] and slack.saved[1] == [0, 1]


# ---- answers sent back as text ----------------------------------------------------------------

PIECES = {29: "", 30: ",", 31: " and", 2: "", 9: " why", 40: " so", 41: " s", 42: "o"}  # 2: EOS


def decode_pieces(ids):
    return "".join(PIECES[i] for i in ids).lstrip()


def encode_pieces(text):
    return {", and": [29, 30, 31], "so": [40], "s": [41]}[text]


def test_an_answer_encoded_again_is_read_as_generated():
    """The module docstring's example; EOS after the answer stays; earlier answers first; the answers
    the prompt then holds as generated come with it."""
    answer = Answer(3, [30, 31])
    row = RowState([1, 7, 8, 30], 1, [answer])

    def read(prompt, rows=(row,), longest=None):
        return with_generated_answer(prompt, rows, decode_pieces, encode_pieces, longest)

    assert read([1, 7, 8, 29, 30, 31, 2, 9]) == ([1, 7, 8, 30, 31, 2, 9], [answer])
    sent = [1, 7, 8, 30, 31, 2, 9]  # sent back as generated: nothing to replace
    assert read(sent)[0] is sent and read(sent)[1] == [answer]
    assert read([1, 7, 8]) == ([1, 7, 8], [])  # the same request again
    assert read([1, 7, 6, 29, 30, 31, 2]) == ([1, 7, 6, 29, 30, 31, 2], [])  # another prompt before the answer
    assert read([1, 7, 8, 29, 30, 31, 2], longest=5) == ([1, 7, 8, 29, 30, 31, 2], [])  # too long with the answer's ids
    assert read([1, 7, 8, 29, 30, 31, 9]) == ([1, 7, 8, 29, 30, 31, 9], [])  # a completion going on past its text
    # an encoding that decodes to nothing more past the answer (EOS here) is not taken into it
    assert answer_length([1, 7, 8, 29, 30, 31, 2, 9], Answer(3, [30, 31]), decode_pieces, lambda text: [0] * 9) == 3
    # two turns: the first answer is replaced, then the second lines up with the row
    second = Answer(8, [41, 42])  # "so" generated as "s" "o"
    held = [1, 7, 8, 30, 31, 2, 9, 5, 41]
    two = RowState(held, 2, [answer, second])
    prompt = [1, 7, 8, 29, 30, 31, 2, 9, 5, 40, 2, 9]
    assert read(prompt, [row, two]) == ([1, 7, 8, 30, 31, 2, 9, 5, 41, 42, 2, 9], [answer, second])
    assert kept_answers([answer, second], held + [42, 2, 9], 9) == [answer, second]
    assert kept_answers([answer, second], held[:8], 7) == [answer]


# ---- the engine: answers sent back as text, the same request again, an edited message -----------


def chat_turn(engine, prompt, max_tokens, **settings):
    """One request; returns (the request, its tokens, its logprobs, its text as the server streams a chat's)."""
    events = []
    request = engine.submit(prompt, RequestSettings(max_tokens=max_tokens, logprobs=0, leading_space=False, **settings), events.append)
    while engine.step():
        pass
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    return request, [e.token for e in tokens], [e.logprob for e in tokens], "".join(e.text for e in tokens) + events[-1].text


def read_alone(model, tokenizer, prompt, max_tokens):
    """Tokens and logprobs of an engine that reads ``prompt`` whole."""
    engine = Engine(model, tokenizer, rows=1, decode="eager", prefix_reuse=False)
    _, tokens, logprobs, _ = chat_turn(engine, prompt, max_tokens)
    return tokens, logprobs


QUESTIONS = ["Who made the heaven and the earth?", "And what did he say unto Moses?",
             "Where went the children of Israel?", "What is the law of the LORD?"]  # fmt: skip


@pytest.mark.parametrize("rows, slack", [(1, 24), (2, 24), (2, 0)])
def test_a_chat_sent_back_as_text_continues_its_row_and_regenerates_from_it(tiny, rows, slack):
    """A chat through the template, answers cut by max_tokens and sent back as their text, past the
    window (32) from the second turn: every later turn continues its row at its end (the ids a cut
    answer encodes back to differ from those generated), and the same request sent again (with
    slack 24, more than an answer) steps back into the wrapped row to the prompt's last token, on
    one row in place or on two from a copy. Without slack it starts from what the other row holds
    (the chat before this turn's message), and the chat goes on from there as well. Tokens and logprobs equal those of the same prompt read whole."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, rows=rows, decode="eager", slack=slack)
    messages, held, substituted = [], 0, 0
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        sent = chat_prompt(tokenizer, messages)
        request, tokens, logprobs, text = chat_turn(engine, sent, 20)
        assert request.reused == held  # the row's end (0 at the first turn)
        substituted += request.prompt != sent
        again, tokens_again, logprobs_again, text_again = chat_turn(engine, sent, 20)
        assert again.prompt == request.prompt
        if slack:
            assert again.reused == len(request.prompt) - 1
        else:  # what another row holds at most: the chat before this turn's message
            assert again.reused <= request.reused
        assert tokens_again == tokens and logprobs_again == pytest.approx(logprobs, abs=1e-5)
        alone, alone_logprobs = read_alone(model, tokenizer, request.prompt, 20)
        assert tokens == alone and logprobs == pytest.approx(alone_logprobs, abs=1e-5)
        held = len(again.prompt) + len(tokens_again) - 1
        messages.append({"role": "assistant", "content": text_again})  # the chat goes on from the answer sent again
    assert substituted >= 1 and held > 3 * model.args.sliding_window


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_an_edited_last_message_steps_back_into_a_wrapped_row(tiny, decode):
    """A 60-token prompt (past the window) and a 6-token answer, then the same prompt with its last 4
    tokens changed: with slack 16 the row steps back 10 tokens (its last prompt tokens were read in a
    step of their own, so their pushed-out positions were kept); without slack it cannot, and reads
    the prompt again. Tokens and logprobs equal the prompt read whole."""
    model, tokenizer = tiny
    rng = random.Random(7)
    prompt = [1] + [rng.randrange(3, 2000) for _ in range(59)]
    edited = prompt[:-4] + [rng.randrange(3, 2000) for _ in range(4)]
    for slack, reused in ((16, 56), (0, 0)):
        engine = Engine(model, tokenizer, rows=1, decode=decode, slack=slack)
        chat_turn(engine, prompt, 6, ignore_eos=True)
        request, tokens, logprobs, _ = chat_turn(engine, edited, 6, ignore_eos=True)
        assert request.reused == reused
        alone, alone_logprobs = read_alone(model, tokenizer, edited, 6)
        assert tokens == alone and logprobs == pytest.approx(alone_logprobs, abs=1e-5)


def test_slack_steps_back_in_the_windowed_layers_beside_full_attention():
    """Layers [full, W = 8]: the same request again steps back into a row past the window, where only
    the windowed layer needed its slack; tokens and logprobs equal the prompt read whole."""
    from conftest import random_model, tiny_args

    model = random_model(tiny_args(sliding_window=[None, 8]))
    model = model.to(torch.float32)
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    rng = random.Random(9)
    prompt = [1] + [rng.randrange(3, 128) for _ in range(29)]
    engine = Engine(model, tokenizer, rows=1, decode="eager", max_model_len=64, slack=8)
    assert [kind.window for kind in engine.cache.kinds] == [None, 8] and engine.slack.keys[0] is None
    first, tokens, logprobs, _ = chat_turn(engine, prompt, 6, ignore_eos=True)
    assert engine.slack.saved[0] == [0, 8]
    again, tokens_again, logprobs_again, _ = chat_turn(engine, prompt, 6, ignore_eos=True)
    assert again.reused == len(prompt) - 1
    assert tokens_again == tokens and logprobs_again == pytest.approx(logprobs, abs=1e-5)
    alone = Engine(model, tokenizer, rows=1, decode="eager", max_model_len=64, prefix_reuse=False)
    _, tokens_alone, logprobs_alone, _ = chat_turn(alone, prompt, 6, ignore_eos=True)
    assert tokens == tokens_alone and logprobs == pytest.approx(logprobs_alone, abs=1e-5)


def test_sizing_counts_the_slack():
    from mixtral_infer.serve.sizing import plan_rows

    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    plain = plan_rows(model, prefill_tokens=16, max_rows=2)
    with_slack = plan_rows(model, prefill_tokens=16, max_rows=2, slack=16)
    args = model.args
    assert with_slack.row_bytes - plain.row_bytes == 2 * args.n_layers * 16 * args.n_kv_heads * args.head_dim * 4
    assert with_slack.row_bytes == plain.row_bytes * 3 // 2  # window 32, slack 16
    assert "32 (and 16 slack) slots" in with_slack.describe()
    engine = Engine(model, Tokenizer.from_folder("tiny-mixtral"), rows=2, decode="eager", slack=16)
    assert engine.cache.nbytes() + engine.slack.nbytes() == 2 * with_slack.row_bytes


class Rows(list):
    """RowStates, with the rows running requests hold (``busy``)."""

    busy: frozenset = frozenset()


def rows(*ids, busy=(), used=None):
    states = Rows(RowState(list(i), (used or {}).get(r, r)) for r, i in enumerate(ids))
    states.busy = frozenset(busy)
    return states


def place(prompt, states, slots, window):
    return prefix_reuse.place(prompt, states, states.busy, [BufferKind(slots, window)])


def test_place_continues_a_kept_row_in_place_and_prefers_the_longest():
    long = list(range(1, 41))
    states = rows([], long[:20], long[:30])
    assert place(long, states, 64, None) == Placement(2, 30)  # its end: in place
    assert place([99] + long, states, 64, None) == Placement(0, 0)  # nothing shared: the empty row first


def test_place_copies_a_shared_prefix_and_keeps_its_source():
    system = list(range(1, 31))
    states = rows(system + [50, 51], [], system + [60])
    # two rows share the system prompt with a new user: copied from the most recent into the empty row
    assert place(system + [70, 71], states, 64, None) == Placement(1, 30, 2)
    states[1].ids = [9]  # no empty row left: the least recently used other row (row 0) is evicted
    assert place(system + [70, 71], states, 64, None) == Placement(0, 30, 2)


def test_place_reads_short_prefixes_again_and_copies_from_running_rows():
    short = list(range(1, MIN_REUSED_TOKENS))  # one token less than is worth a copy
    states = rows(short + [7], [], busy=(0,))
    assert place(short + [8, 9], states, 64, None) == Placement(1, 0)
    longer = list(range(1, MIN_REUSED_TOKENS + 2))
    states = rows(longer + [7], [], busy=(0,))
    assert place(longer + [8], states, 64, None) == Placement(1, len(longer), 0)
    assert place(longer + [8], rows(longer, busy=(0,)), 64, None) is None  # nothing free


def test_place_cuts_a_lone_free_row_back_in_place():
    """When the matching row is the only free one, it is cut back where it stands (no copy)."""
    kept = list(range(1, 41))
    assert place(kept[:20] + [99], rows(kept), 64, None) == Placement(0, 20)
    assert place(kept[:20] + [99], rows(kept + list(range(41, 70))), 64, 64) == Placement(0, 0)  # wrapped
    assert place(kept[:10] + [99], rows(kept), 64, None) == Placement(0, 0)  # too short to be worth it


# ---- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")  # window 32
    return model, Tokenizer.from_folder("tiny-mixtral")


def run_turns(engine, turns, max_tokens=6, seed=None):
    """A chat of ``turns`` (lists of new user ids) on ``engine``: each turn's prompt is the last one,
    its answer (and EOS if it ended there) and the new ids. Returns each turn's (tokens, logprobs,
    prompt length)."""
    prompt, out = [], []
    for user in turns:
        prompt = prompt + user
        events = []
        settings = RequestSettings(max_tokens=max_tokens, logprobs=0, temperature=0.8 if seed is not None else 0.0, seed=seed)
        engine.submit(prompt, settings, events.append)
        while engine.step():
            pass
        tokens = [e.token for e in events if isinstance(e, TokenEvent)]
        out.append((tokens, [e.logprob for e in events if isinstance(e, TokenEvent)], len(prompt)))
        prompt = prompt + tokens + ([engine.tokenizer.eos_id] if events[-1].reason == "stop" else [])
    return out


def user_turns(n, length, seed=0):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 2000) for _ in range(length - 1)]] + [
        [rng.randrange(3, 2000) for _ in range(length)] for _ in range(n - 1)
    ]


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("seed", [None, 5])
def test_a_chat_from_its_row_equals_one_read_again_past_the_window(tiny, decode, seed):
    """Six turns of 12 new tokens and 6-token answers run past the window (32) from the third turn:
    with reuse each turn reads only its new tokens (and the answer's last one), and every token and
    logprob equals those of an engine that reads the whole conversation again."""
    model, tokenizer = tiny
    turns = user_turns(6, 12)
    engines = {reuse: Engine(model, tokenizer, rows=2, decode=decode, prefix_reuse=reuse) for reuse in (True, False)}
    results = {reuse: run_turns(engine, turns, seed=seed) for reuse, engine in engines.items()}
    for (tokens, logprobs, length), (tokens_again, logprobs_again, _) in zip(results[True], results[False]):
        assert tokens == tokens_again
        assert logprobs == pytest.approx(logprobs_again, abs=1e-5)
    assert results[True][-1][2] > 2 * model.args.sliding_window
    reuse = engines[True]
    assert reuse.prefix_hits == 5 and engines[False].prefix_hits == 0
    # each later turn continues its row at its end: the previous prompt and the answer but its last token
    expected = sum(length + len(tokens) - 1 for tokens, _, length in results[True][:-1])
    assert reuse.reused_tokens == expected


def test_a_kept_row_is_never_used_for_ids_that_differ(tiny):
    """Prompts that share prefixes of random lengths with kept rows, and differ from them at one
    position: every answer equals that of an engine without reuse, and no request skips a token past
    the first difference with the row it took."""
    model, tokenizer = tiny
    rng = random.Random(3)
    base = [1] + [rng.randrange(3, 2000) for _ in range(60)]
    prompts = []
    for _ in range(24):
        prompt = base[: rng.randrange(2, 61)] + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 8))]
        if rng.random() < 0.5:
            where = rng.randrange(1, len(prompt))
            prompt[where] = (prompt[where] + 1) % 2000 or 3
        prompts.append(prompt)
    answers = {}
    for reuse in (True, False):
        engine = Engine(model, tokenizer, rows=3, decode="eager", prefix_reuse=reuse)
        taken = []
        admit = engine._admit

        def checked(request, placement=None):
            admit(request, placement)
            held = engine.row_states[request.row].ids
            assert held == request.prompt[: request.reused]  # what the row holds is the prompt's start
            taken.append(request.reused)

        engine._admit = checked
        got = []
        for i, prompt in enumerate(prompts):
            events = []
            engine.submit(prompt, RequestSettings(max_tokens=3, logprobs=0), events.append)
            if i % 2:  # two at a time now and then: kept rows and running ones
                continue
            while engine.step():
                pass
            got.append(events)
        while engine.step():
            pass
        answers[reuse] = [[(e.token, e.logprob) for e in events if isinstance(e, TokenEvent)] for events in got]
        if reuse:
            assert sum(taken) > 0
    for a, b in zip(answers[True], answers[False]):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-5)


@pytest.mark.parametrize("length", [20, 40])
def test_a_shared_system_prompt_is_read_once_for_users_arriving_together(tiny, length):
    """Four users with one system prompt (within the window of 32, and past it) arrive at once: the
    first reads it, pausing at its end, the others wait for it and copy it into their rows; their
    answers equal those without reuse."""
    model, tokenizer = tiny
    rng = random.Random(1)
    system = [1] + [rng.randrange(3, 2000) for _ in range(length - 1)]
    prompts = [system + [rng.randrange(3, 2000) for _ in range(5)] for _ in range(4)]
    answers, read = {}, {}
    for reuse in (True, False):
        engine = Engine(model, tokenizer, rows=4, decode="eager", prefill_tokens=64, prefix_reuse=reuse)
        events = [[] for _ in prompts]
        for prompt, sink in zip(prompts, events):
            engine.submit(prompt, RequestSettings(max_tokens=4, logprobs=0), sink.append)
        while engine.step():
            pass
        answers[reuse] = [[(e.token, e.logprob) for e in ev if isinstance(e, TokenEvent)] for ev in events]
        read[reuse] = sum(len(p) for p in prompts) - engine.reused_tokens
    assert read[False] == 4 * (length + 5) and read[True] == length + 4 * 5
    for a, b in zip(answers[True], answers[False]):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-5)


def test_n_choices_read_their_prompt_once_and_sample_as_alone(tiny):
    """Three choices of one 50-token prompt (longer than the window): the first reads it, the others
    take a copy of its row and sample their first token from the same logits; each choice's tokens
    equal those of the same seed alone."""
    model, tokenizer = tiny
    rng = random.Random(2)
    prompt = [1] + [rng.randrange(3, 2000) for _ in range(49)]
    engine = Engine(model, tokenizer, rows=3, decode="eager", prefix_reuse=False)  # the copy needs no reuse
    events = [[] for _ in range(3)]
    first = engine.submit(prompt, RequestSettings(max_tokens=5, temperature=0.9, seed=10), events[0].append)
    for i in (1, 2):
        engine.submit(prompt, RequestSettings(max_tokens=5, temperature=0.9, seed=10 + i), events[i].append, follows=first)
    while engine.step():
        pass
    assert engine.reused_tokens == 2 * len(prompt)  # the prompt was read once
    for i in range(3):
        alone = Engine(model, tokenizer, rows=1, decode="eager")
        solo = []
        alone.submit(prompt, RequestSettings(max_tokens=5, temperature=0.9, seed=10 + i), solo.append)
        while alone.step():
            pass
        assert [e.token for e in events[i] if isinstance(e, TokenEvent)] == [e.token for e in solo if isinstance(e, TokenEvent)]
        assert isinstance(events[i][-1], Finished) and events[i][-1].prompt_tokens == len(prompt)


def test_a_nan_row_is_forgotten(tiny):
    """A row cleared after non-finite logits holds nothing to reuse."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, rows=1, decode="eager")
    engine.submit([1, 5, 6, 7], RequestSettings(max_tokens=2), lambda e: None)
    while engine.step():
        pass
    assert engine.row_states[0].ids == [1, 5, 6, 7, engine.row_states[0].ids[-1]]
    engine._clear_rows([0])
    assert engine.row_states[0].ids == [] and engine.cache.cache_k[:, 0].abs().sum() == 0


# ---- where the match is made: ids after the chat template ----------------------------------

ANSWERS = ["The answer is 42.", "Yes, and then:\n- one\n- two", "Café au lait, naïve résumé.", "It rains. It pours!"]


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_an_answer_sent_back_as_text_lines_up_with_the_ids_the_row_holds(version, v3_folder):
    """The next turn's ids continue the row at its end: the template re-encodes an answer's text to
    the ids that were generated (for answers a tokenizer would write itself) and puts EOS after it,
    where the row holds the prompt and every answer token the model was fed."""
    tokenizer = Tokenizer.from_folder("tiny-mistral" if version == "v1" else v3_folder)
    assert tokenizer.version == version
    for answer in ANSWERS:
        question = [{"role": "user", "content": "What is it?"}]
        prompt = chat_prompt(tokenizer, question)
        generated = tokenizer.encode(answer, bos=False)  # as a model writes it, then EOS (never fed)
        # the answer's text as the server streams it (chat: no leading space) comes back in the history
        stream = TextStream(tokenizer, leading_space=False)
        text = "".join(stream.push(t) for t in generated) + stream.finish()
        assert text == answer
        follow_up = chat_prompt(tokenizer, question + [{"role": "assistant", "content": text}, {"role": "user", "content": "Why?"}])
        held = prompt + generated  # the row: prompt and answer, all fed (the EOS sampled last was not)
        assert follow_up[: len(held)] == held and follow_up[len(held)] == tokenizer.eos_id
        assert reusable_length(held, follow_up, [BufferKind(8, 8)]) == len(held)  # even wrapped: at its end


# ---- the Python API: a batch that begins alike reads its beginning once ----------------------


def test_shared_prefix_length_docstring_example():
    from mixtral_infer.generation.shared_prefix import shared_prefix_length

    assert shared_prefix_length([[1] * 20 + [4], [1] * 20 + [9, 9]]) == 20
    assert shared_prefix_length([[1] * 20 + [4]]) == 0  # one prompt
    assert shared_prefix_length([[1] * 10 + [4], [1] * 10 + [5]]) == 0  # fewer than 16 in common
    assert shared_prefix_length([[1] * 20, [1] * 30]) == 19  # each keeps one token of its own


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_batch_that_begins_alike_reads_the_beginning_once_and_generates_as_each_alone(tiny, decode, monkeypatch):
    """Three prompts sharing 40 tokens (past the window of 32): the shared part is read once (counted
    through the forward passes), and tokens and logprobs (prompt ones included) equal each prompt alone."""
    from mixtral_infer import generate
    from mixtral_infer.generation import generate as generate_module

    model, _ = tiny
    batch = load_model("tiny-mixtral", max_batch_size=3, dtype=torch.float32, device="cpu")
    rng = random.Random(4)
    shared = [1] + [rng.randrange(3, 2000) for _ in range(39)]
    prompts = [shared + [rng.randrange(3, 2000) for _ in range(n)] for n in (1, 3, 6)]
    read = []
    counting = generate_module.forward

    def counted(model, input_ids, *args, **kwargs):
        read.append(len(input_ids))
        return counting(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(generate_module, "forward", counted)
    monkeypatch.setattr("mixtral_infer.generation.shared_prefix.forward", counted)
    together, together_lp = generate(prompts, batch, max_tokens=5, decode=decode)
    assert read[:2] == [40, 1 + 3 + 6]  # the shared part, then the own tokens (decode steps come after)
    for i, prompt in enumerate(prompts):
        alone, alone_lp = generate([prompt], model, max_tokens=5, decode=decode)
        assert together[i] == alone[0]
        assert together_lp[i] == pytest.approx(alone_lp[0], abs=1e-5)
        assert len(together_lp[i]) == len(prompt) - 1 + len(alone[0])
