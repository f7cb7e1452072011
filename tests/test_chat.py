"""A conversation continued through the rotating cache answers as if it re-read the whole history."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import random_model, tiny_args
from hypothesis import given, settings
from hypothesis import strategies as st

from mixtral_infer import GenerationError, Tokenizer, generate
from mixtral_infer.generation.chat import Conversation, Reply
from mixtral_infer.generation.text_stream import TextStream


@pytest.fixture(params=[8, None], ids=["window", "no-window"])
def chat_parts(request, tokenizer_path):
    args = dataclasses.replace(tiny_args(sliding_window=request.param), vocab_size=400)
    return random_model(args, seed=12), Tokenizer(tokenizer_path)


def answer_from_scratch(model, tokenizer, history, max_tokens):
    """What a fresh greedy generation over the whole history says."""
    generated, _ = generate([history], model, max_tokens=max_tokens, eos_id=tokenizer.eos_id)
    return generated[0]


def test_later_turns_see_earlier_ones(chat_parts):
    model, tokenizer = chat_parts
    conversation = Conversation(model, tokenizer, instruct=True, max_tokens=20)
    conversation.reply("first question")
    history = list(conversation.history)
    assert history[0] == tokenizer.bos_id
    pieces = []
    answer = conversation.reply("and a second one", emit=pieces.append).text
    turn = tokenizer.encode("[INST] and a second one [/INST]", bos=False)
    expected = answer_from_scratch(model, tokenizer, history + turn, 20)
    assert conversation.history[len(history) + len(turn) :][: len(expected)] == expected
    assert "".join(pieces) == answer == tokenizer.decode(expected)
    if model.args.sliding_window is not None:
        assert conversation.cache.cache_size == model.args.sliding_window  # constant memory
        assert conversation.cache.tokens_seen[0] > 3 * model.args.sliding_window


def test_ctrl_c_stops_the_answer_and_keeps_the_session(chat_parts):
    model, tokenizer = chat_parts
    conversation = Conversation(model, tokenizer, instruct=True, max_tokens=20)
    conversation.reply("hello")
    received = []

    def interrupt_after_three(piece):
        received.append(piece)
        if len(received) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        conversation.reply("tell me more", emit=interrupt_after_three)
    history = list(conversation.history)
    turn = tokenizer.encode("[INST] go on [/INST]", bos=False)
    answer = conversation.reply("go on").text
    assert answer == tokenizer.decode(answer_from_scratch(model, tokenizer, history + turn, 20))


def test_plain_mode_treats_each_line_as_a_new_prompt(chat_parts):
    model, tokenizer = chat_parts
    conversation = Conversation(model, tokenizer, max_tokens=10)
    conversation.reply("something else first")
    answer = conversation.reply("The module").text
    expected = answer_from_scratch(model, tokenizer, tokenizer.encode("The module"), 10)
    assert answer.strip() == tokenizer.decode(expected).strip()


def test_turn_seeds_wrap_at_the_largest_seed(chat_parts):
    """Turn t samples with seed + t: from the largest seed, 2**63 - 1, the second turn draws with 0
    (it was refused as a seed out of range, one the user never gave)."""
    model, tokenizer = chat_parts
    settings = dict(max_tokens=6, temperature=1.0)
    conversation = Conversation(model, tokenizer, seed=2**63 - 1, **settings)
    conversation.reply("The module")
    second = conversation.reply("The module").text
    assert second == Conversation(model, tokenizer, seed=0, **settings).reply("The module").text


def test_text_stream_holds_back_half_characters(tokenizer_path):
    tokenizer = Tokenizer(tokenizer_path)
    shown = []
    stream = TextStream(tokenizer, leading_space=False)
    for token in tokenizer.encode("naïve 中文 🙂", bos=False):
        shown.append(stream.push(token))
    assert "".join(shown) == "naïve 中文 🙂"
    assert all("\ufffd" not in piece for piece in shown)


SHIPPED_TOKENIZER = Tokenizer.from_folder("tiny-mixtral")


def test_text_stream_worked_example():
    """The example in TextStream's docstring, on the shipped tokenizer (你 has no piece: three byte pieces)."""
    tokenizer = SHIPPED_TOKENIZER
    ids = tokenizer.encode("And the你", bos=False)
    assert [tokenizer.id_to_piece(i) for i in ids] == ["\u2581And", "\u2581the", "<0xE4>", "<0xBD>", "<0xA0>"]
    shown = []
    stream = TextStream(tokenizer, leading_space=True)
    starts = []
    for token in ids:
        shown.append(stream.push(token))
        starts.append(stream.start)
    assert [piece for piece in shown if piece] == [" And", " the", "你"]
    assert starts == [0, 1, 1, 1, 2]


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(3, SHIPPED_TOKENIZER.n_words - 1), max_size=30),
    leading_space=st.booleans(),
    finished=st.booleans(),
)
def test_streamed_text_is_the_whole_decode(ids, leading_space, finished):
    """Any token sequence (byte pieces in any order, lone ``▁``, leading spaces): the pieces add up to one decode."""
    tokenizer = SHIPPED_TOKENIZER
    shown = []
    stream = TextStream(tokenizer, leading_space=leading_space)
    for token in ids:
        shown.append(stream.push(token))
    whole = tokenizer.decode_continuation(ids) if leading_space else tokenizer.decode(ids)
    if finished:
        shown.append(stream.finish())
        assert "".join(shown) == whole
    else:  # only a trailing half character may be held back
        assert whole.startswith("".join(shown))
        assert "".join(shown) == whole or whole.endswith("\ufffd")


def test_streaming_decodes_each_token_a_bounded_number_of_times():
    """Incremental: decoding work grows with the answer's length, not with its square."""
    tokenizer = SHIPPED_TOKENIZER
    ids = tokenizer.encode("And the LORD spake unto Moses, saying, 你好 " * 40, bos=False)
    decoded = []

    class Counting:
        def decode(self, tokens):
            decoded.append(len(tokens))
            return tokenizer.decode(tokens)

        def decode_continuation(self, tokens):
            decoded.append(len(tokens))
            return tokenizer.decode_continuation(tokens)

    shown = []
    stream = TextStream(Counting(), leading_space=True)
    for token in ids:
        shown.append(stream.push(token))
    shown.append(stream.finish())
    assert "".join(shown) == tokenizer.decode_continuation(ids)
    assert len(ids) > 400
    assert sum(decoded) <= 2 * 4 * len(ids)  # two decodes per token of at most the tokens since the last piece (+ a character's bytes)
    # The last piece shown is decoded again at every push (2 calls per token); a one-token piece's
    # text comes from the per-tokenizer cache after its first time: here 812 calls for 641 tokens.
    assert len(decoded) <= 1.3 * len(ids)

    class Unhashable(Counting):
        __hash__ = None  # cannot be a weak key: the stream keeps its own cache

    stream = TextStream(Unhashable(), leading_space=True)
    assert "".join([stream.push(token) for token in ids] + [stream.finish()]) == tokenizer.decode_continuation(ids)


def test_a_reply_leaves_the_time_its_step_took_to_compile_out_of_its_rate():
    plain = Reply("x", tokens=12, seconds=0.3, first_token_seconds=0.08, hit_max_tokens=False)
    assert plain.stats() == "12 tokens, 40.0 tokens/s, first token after 0.08 s"
    compiled = Reply("x", tokens=12, seconds=40.5, first_token_seconds=40.3, hit_max_tokens=False, compile_seconds=40.2)
    expected = "12 tokens, 40.0 tokens/s, first token after 40.30 s (40.2 s compiling the decode step, once)"
    assert compiled.stats() == expected


def test_a_system_prompt_comes_before_the_first_turn_as_the_server_renders_it():
    import torch

    from mixtral_infer import Conversation, Tokenizer, load_model
    from mixtral_infer.serve.protocol import chat_prompt

    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    chat = Conversation(model, tokenizer, instruct=True, system="Answer briefly.", max_tokens=4, temperature=0)
    chat.reply("Who made the earth?")
    expected = chat_prompt(tokenizer, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Who made the earth?"}])
    assert chat.history[: len(expected)] == expected
    with pytest.raises(GenerationError, match="needs instruct=True"):
        Conversation(model, tokenizer, system="x")
