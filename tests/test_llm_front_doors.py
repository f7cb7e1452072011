"""``LLM`` answers as the server does: stop strings found in the text it returns, a seed per prompt,
``n`` answers of one prompt (issue 72, items 7-9). On the shipped tiny-mixtral, in float32."""

from __future__ import annotations

import pytest
import torch

from mixtral_infer import LLM, GenerationError, SamplingParams, generate
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


# ---- 8: a seed per prompt -----------------------------------------------------------------------

PROMPTS = ["And God said", "In the beginning", "Blessed are", "The LORD is my shepherd", "Hear, O Israel", "And God said"]


def test_a_prompts_sampled_text_does_not_depend_on_its_batch(llm, monkeypatch):
    """Seed 42: a prompt's text alone, three times in one batch, beside other prompts, and with the
    batches split by free memory (here one prompt a batch) is one text (three copies gave three texts,
    none the text alone: one generator drew for the whole batch)."""
    settings = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=42)
    alone = {p: llm.generate(p, settings)[0].text for p in set(PROMPTS)}
    assert [o.text for o in llm.generate([PROMPT] * 3, settings)] == [alone[PROMPT]] * 3
    together = [o.text for o in llm.generate(PROMPTS, settings)]  # batches of 4 and 2 (max_batch=4)
    assert together == [alone[p] for p in PROMPTS]
    monkeypatch.setattr("mixtral_infer.llm.free_memory", lambda device: 1)  # no room: a batch is one prompt
    assert llm._batch_size(len(PROMPTS), 20) == 1
    assert [o.text for o in llm.generate(PROMPTS[::-1], settings)] == [alone[p] for p in PROMPTS[::-1]]


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_generate_samples_each_row_with_its_own_seed(llm, decode):
    """A list of seeds gives each prompt its own; a row's tokens are those it gets alone with its seed."""
    ids = [llm.tokenizer.encode(p, bos=True) for p in PROMPTS[:3]]
    kwargs = dict(max_tokens=6, temperature=1.0, prompt_logprobs=False, decode=decode)
    rows, _ = generate(ids, llm.model, seed=[7, 8, 9], **kwargs)
    assert rows == [generate([p], llm.model, seed=s, **kwargs)[0][0] for p, s in zip(ids, [7, 8, 9])]
    with pytest.raises(GenerationError, match=r"seed=\[7, 8\] must be one integer, or a list of one per prompt \(3\)"):
        generate(ids, llm.model, seed=[7, 8], **kwargs)
    with pytest.raises(GenerationError, match=r"seed\[1\]=-1 must be an integer in \[0, 2\*\*63\)"):
        generate(ids, llm.model, seed=[7, -1, 9], **kwargs)
