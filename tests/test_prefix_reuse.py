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
    Placement,
    RowState,
    can_cut_back,
    reusable_length,
)
from mixtral_infer.model.cache import BufferKind, copied_slots
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
