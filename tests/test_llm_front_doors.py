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
    from mixtral_infer.generation import generate
    from mixtral_infer.serve import engine

    assert engine.AnswerText is generate.AnswerText is text_stream.AnswerText  # TextStream through StopStrings


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


# ---- 9: n answers of one prompt -----------------------------------------------------------------


def test_n_answers_sample_after_one_reading_of_the_prompt(llm):
    """``SamplingParams(n=3)`` (a TypeError before): vLLM's shape, ``outputs`` of 3 answers; answer i
    with seed 42 is the prompt's answer with seed 42 + i (the server's ``n``); each prompt is read
    once, also when its answers fill a batch of their own (max_batch=4: 3 rows a batch)."""
    tokens_read = []
    hook = llm.model.register_forward_pre_hook(lambda module, args: tokens_read.append(args[0].numel()))
    try:
        outs = llm.generate([PROMPT, "Blessed are"], SamplingParams(n=3, max_tokens=1, seed=42))
    finally:
        hook.remove()
    ids = [llm.tokenizer.encode(p, bos=True) for p in (PROMPT, "Blessed are")]
    assert sum(tokens_read) == len(ids[0]) + len(ids[1])  # max_tokens=1: the prefill's forwards only
    assert [len(o.outputs) for o in outs] == [3, 3] and [o.prompt_token_ids for o in outs] == ids

    [out] = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=8, seed=42))
    alone = [llm.generate(PROMPT, max_tokens=8, seed=42 + i)[0] for i in range(3)]
    assert [a.index for a in out.outputs] == [0, 1, 2]
    assert [(a.text, a.token_ids, a.finish_reason) for a in out.outputs] == [(a.text, a.token_ids, a.finish_reason) for a in alone]
    assert [a.logprobs for a in out.outputs] == [pytest.approx(a.logprobs, abs=1e-5) for a in alone]
    assert len({a.text for a in out.outputs}) == 3  # seed + i: the answers differ
    assert (out.text, out.token_ids, out.finish_reason) == (out.outputs[0].text, out.outputs[0].token_ids, "length")
    assert out.outputs[1].cumulative_logprob == pytest.approx(sum(alone[1].logprobs), abs=1e-4)


def test_n_in_chat_and_its_check(llm):
    answer = llm.chat([{"role": "user", "content": "Who art thou?"}], n=2, max_tokens=4, temperature=0)
    assert [a.index for a in answer.outputs] == [0, 1] and answer.outputs[0].text == answer.outputs[1].text  # greedy
    for bad in (0, 1.5, True):
        with pytest.raises(GenerationError, match=rf"n={bad!r} must be an integer >= 1"):
            llm.generate(PROMPT, n=bad)
    with pytest.raises(GenerationError, match=r"seed=-1 must be an integer in \[0, 2\*\*63\)"):
        llm.generate(PROMPT, n=2, seed=-1)  # not wrapped round to 2**63 - 1 by answer 1's seed + 1


def test_generate_reads_a_repeated_prompt_once(llm):
    """Rows 2 and 3 repeat rows 0 and 1: they sit the prefill out and get copies of those rows, their
    logits and their prompt logprobs; every row's tokens and logprobs are those of its prompt alone."""
    a = llm.tokenizer.encode(PROMPT, bos=True)
    b = llm.tokenizer.encode("In the beginning God created the heaven and the earth. And the earth was without form", bos=True)
    kwargs = dict(max_tokens=5, temperature=1.0)
    tokens_read = []
    hook = llm.model.register_forward_pre_hook(lambda module, args: tokens_read.append(args[0].numel()))
    try:
        rows, logprobs = generate([a, b, a, b], llm.model, seed=[1, 2, 3, 4], decode="eager", **kwargs)
    finally:
        hook.remove()
    assert sum(tokens_read) == len(a) + len(b) + 4 * 4  # the prompts once, then 4 decode steps of 4 rows
    for row, (prompt, seed) in enumerate(zip([a, b, a, b], [1, 2, 3, 4])):
        [alone], [alone_logprobs] = generate([prompt], llm.model, seed=seed, decode="eager", **kwargs)
        assert rows[row] == alone and logprobs[row] == pytest.approx(alone_logprobs, abs=1e-5)


def test_repeated_prompts_docstring_example():
    from mixtral_infer.generation.shared_prefix import repeated_prompts

    assert repeated_prompts([[1, 5], [1, 6], [1, 5], [1, 5]]) == [0, 1, 0, 0]
