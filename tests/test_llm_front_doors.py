"""``LLM`` answers as the server does: stop strings found in the text it returns, a seed per prompt,
``n`` answers of one prompt (issue 72, items 7-9). On the shipped tiny-mixtral, in float32."""

from __future__ import annotations

import pytest
import torch

from mixtral_infer import LLM, SamplingParams, generate
from mixtral_infer.generation import text_stream

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "And God said"  # greedy: " unto him, Thou art my son, ..."; its first token is ▁unto


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-mixtral", dtype=torch.float32, device="cpu", max_batch=4)


# ---- 7: a stop string at the very start ---------------------------------------------------------


def test_a_stop_string_at_the_start_of_the_answer_stops_it(llm):
    """The text keeps the space before its first word (" unto"), and so does the stop check: the answer
    ends at its first token, empty, "stop" (it ran 20 tokens, "length", with text '')."""
    [out] = llm.generate(PROMPT, max_tokens=20, temperature=0, stop=[" unto"])
    assert (out.text, out.finish_reason, len(out.token_ids)) == ("", "stop", 1)
    [whole] = llm.generate(PROMPT, max_tokens=20, temperature=0)
    assert whole.text.startswith(" unto him") and whole.finish_reason == "length"
    [cut] = llm.generate(PROMPT, max_tokens=20, temperature=0, stop=[" him"])
    assert (cut.text, cut.finish_reason, cut.token_ids) == (" unto", "stop", whole.token_ids[:2])


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_generate_ends_a_row_where_the_server_would(llm, decode):
    """``generate`` itself, both decode loops: a continuation's text keeps its leading space, a chat
    answer's (``leading_space=False``, the server's chat) does not, so " unto" matches only the first."""
    ids = [llm.tokenizer.encode(PROMPT, bos=True)] * 2
    kwargs = dict(max_tokens=6, eos_id=llm.tokenizer.eos_id, prompt_logprobs=False, decode=decode, tokenizer=llm.tokenizer)
    continued, _ = generate(ids, llm.model, stop=[" unto"], **kwargs)
    assert [len(t) for t in continued] == [1, 1]
    answer, _ = generate(ids, llm.model, stop=[" unto"], leading_space=False, **kwargs)
    assert [len(t) for t in answer] == [6, 6]


def test_the_server_and_generate_share_one_stop_check():
    from mixtral_infer.serve import engine, text

    assert engine.StopStrings is text_stream.StopStrings is text.StopStrings
    assert engine.TextStream is text_stream.TextStream  # AnswerText is these two, as the engine chains them
