"""The high-level API (``LLM``, ``SamplingParams``), models by their hub name, the public names."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

import mixtral_infer
from mixtral_infer import LLM, CheckpointError, Completion, GenerationError, SamplingParams, Tokenizer, generate, load_model
from mixtral_infer.shipped import resolve_model_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["In the beginning", "And God said", "Blessed are", "The LORD is my shepherd", "Who shall dwell",
           "And it came to pass", "Hear, O Israel", "Praise ye the LORD", "My son, hear", "Vanity of vanities"]  # fmt: skip


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-mixtral", dtype=torch.float32, device="cpu", max_batch=4)


def test_generate_text_in_text_out_in_batches_of_any_size(llm):
    """Ten prompts on a model whose batches hold four: each answer is that prompt's alone."""
    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))
    assert len(outs) == 10 and all(isinstance(o, Completion) for o in outs)
    for prompt, out in zip(PROMPTS, outs):
        alone, logprobs = generate([tokenizer.encode(prompt)], model, max_tokens=8, eos_id=tokenizer.eos_id, prompt_logprobs=False)
        assert out.token_ids == alone[0] and out.text == tokenizer.decode_continuation(alone[0])
        assert out.logprobs == pytest.approx(logprobs[0], abs=1e-5)
        assert out.finish_reason == ("length" if len(alone[0]) == 8 else "stop") and out.prompt == prompt


def test_keyword_settings_a_single_string_and_stop_strings(llm):
    [whole] = llm.generate("And God said", max_tokens=16, temperature=0)
    stop = whole.text[5:8]
    [cut] = llm.generate("And God said", SamplingParams(max_tokens=16, temperature=0.5), temperature=0, stop=[stop])
    assert cut.text == whole.text[: whole.text.index(stop)] and cut.finish_reason == "stop"
    with pytest.raises(GenerationError, match=r"unknown sampling setting\(s\) \['max_token'\]"):
        llm.generate("x", max_token=3)


def test_chat_answers_as_the_conversation_does(llm):
    from mixtral_infer import Conversation

    question = "Who shall dwell in thy holy hill?"
    expected = Conversation(llm.model, llm.tokenizer, instruct=True, max_tokens=8, temperature=0.0).reply(question).text
    answer = llm.chat([{"role": "user", "content": question}], max_tokens=8, temperature=0)
    assert answer.text == expected
    both = llm.chat([[{"role": "user", "content": question}], [{"role": "user", "content": "Why?"}]], max_tokens=4, temperature=0)
    assert [a.text for a in both][0] == llm.chat([{"role": "user", "content": question}], max_tokens=4, temperature=0).text
    with pytest.raises(GenerationError, match="must alternate user, assistant"):
        llm.chat([{"role": "assistant", "content": "x"}])


def test_score_is_the_log_likelihood_per_token(llm):
    text = "In the beginning God created the heaven and the earth."
    score = llm.score(text)
    ids = llm.tokenizer.encode(text)
    logits = llm.model(torch.tensor(ids), [len(ids)])
    expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert score.token_ids == ids and score.token_logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    assert score.perplexity == pytest.approx(math.exp(-expected.mean().item()), rel=1e-4)
    assert f"{score.perplexity:.1f}" == "14.4"  # README's figure for this text


def hub_cache_with(tmp_path: Path, repo: str) -> Path:
    """A Hugging Face cache holding the shipped tiny-mixtral as ``repo``, laid out as the hub lays it out."""
    cache = tmp_path / "hub"
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    snapshot = root / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(resolve_model_folder("tiny-mixtral"), snapshot)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(snapshot.name)
    return cache


def test_a_model_by_its_hub_name_from_the_local_cache(tmp_path, monkeypatch):
    cache = hub_cache_with(tmp_path, "someone/tiny-mixtral-copy")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    llm = LLM("someone/tiny-mixtral-copy", dtype=torch.float32, device="cpu")
    assert llm.generate("And God said", max_tokens=4, temperature=0)[0].token_ids == LLM(
        "tiny-mixtral", dtype=torch.float32, device="cpu").generate("And God said", max_tokens=4, temperature=0)[0].token_ids  # fmt: skip
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub
    assert load_model("someone/tiny-mixtral-copy", dtype=torch.float32).args.n_layers == 4


def test_a_hub_name_not_in_the_cache_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(CheckpointError) as error:
        load_model("mistralai/Mistral-7B-v0.1")
    message = str(error.value)
    assert "mistralai/Mistral-7B-v0.1: model folder not found, nor in the Hugging Face cache" in message
    assert str(tmp_path / "empty") in message and "hf download mistralai/Mistral-7B-v0.1" in message and "\n" not in message


def test_public_names_typed_and_documented(tmp_path):
    for name in ("LLM", "SamplingParams", "Completion", "Conversation", "save_model", "perplexity", "load_model", "generate"):
        assert name in mixtral_infer.__all__ and getattr(mixtral_infer, name).__doc__
    assert (Path(mixtral_infer.__file__).parent / "py.typed").is_file()
    llm = LLM("tiny-mixtral", dtype=torch.float32, device="cpu")
    mixtral_infer.save_model(llm.model, tmp_path / "mine", llm.tokenizer)
    again = LLM(str(tmp_path / "mine"), dtype=torch.float32, device="cpu")
    assert again.generate("And God said", max_tokens=5, temperature=0)[0].text == llm.generate("And God said", max_tokens=5, temperature=0)[0].text
