"""Generation: chunking does not change results, logprobs are consistent, EOS is per sequence."""

from __future__ import annotations

import pytest
import torch
from conftest import WINDOW, random_model, tiny_args
from test_model import random_prompts

from mixtral_infer import Tokenizer, generate, load_model

PROMPT_LENGTHS = [3 * WINDOW + 5, 6, 1, WINDOW]


@pytest.fixture(scope="module", params=["mistral", "mixtral"])
def model(request):
    return random_model(tiny_args(moe=request.param == "mixtral"), seed=3)


def score(model, sequences):
    """Log-probability of every token after the first, by one forward pass without a cache."""
    with torch.no_grad():
        logits = model(torch.tensor([t for s in sequences for t in s]), [len(s) for s in sequences])
    log_probs = torch.log_softmax(logits, dim=-1)
    result, offset = [], 0
    for s in sequences:
        rows = log_probs[offset : offset + len(s) - 1]
        result.append(rows.gather(1, torch.tensor(s[1:])[:, None])[:, 0].tolist())
        offset += len(s)
    return result


@pytest.mark.parametrize("chunk_size", [1, 3, WINDOW, 2 * WINDOW + 3, 100])
def test_chunk_size_does_not_change_tokens_or_logprobs(model, chunk_size):
    prompts = random_prompts(PROMPT_LENGTHS, model.args.vocab_size, seed=4)
    reference_tokens, reference_logprobs = generate(prompts, model, max_tokens=3 * WINDOW, chunk_size=None)
    tokens, logprobs = generate(prompts, model, max_tokens=3 * WINDOW, chunk_size=chunk_size)
    assert tokens == reference_tokens
    for got, expected in zip(logprobs, reference_logprobs):
        assert got == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("chunk_size", [1, 3, WINDOW, 2 * WINDOW + 3])
def test_without_prompt_logprobs_the_tokens_and_generated_logprobs_are_the_same(model, chunk_size):
    """prompt_logprobs=False computes logits for each prompt's last token only; nothing else changes."""
    prompts = random_prompts(PROMPT_LENGTHS, model.args.vocab_size, seed=8)
    settings = dict(max_tokens=2 * WINDOW, temperature=0.8, seed=1, chunk_size=chunk_size)
    reference_tokens, reference_logprobs = generate(prompts, model, **settings)
    tokens, logprobs = generate(prompts, model, prompt_logprobs=False, **settings)
    assert tokens == reference_tokens
    for got, expected, prompt in zip(logprobs, reference_logprobs, prompts):
        assert got == pytest.approx(expected[len(prompt) - 1 :], abs=1e-5)


def test_rescoring_generated_text_gives_the_logprobs_seen_while_generating(model):
    prompts = random_prompts(PROMPT_LENGTHS, model.args.vocab_size, seed=5)
    generated, logprobs = generate(prompts, model, max_tokens=4 * WINDOW, temperature=0.8, seed=0, chunk_size=5)
    full = [p + g for p, g in zip(prompts, generated)]
    for got, expected, sequence in zip(logprobs, score(model, full), full):
        assert len(got) == len(sequence) - 1
        assert got == pytest.approx(expected, abs=1e-4)


def test_each_sequence_stops_at_its_own_eos(model):
    prompts = random_prompts(PROMPT_LENGTHS, model.args.vocab_size, seed=6)
    free, _ = generate(prompts, model, max_tokens=20)
    eos = free[1][4]  # the token sequence 1 emits fifth
    stopped, logprobs = generate(prompts, model, max_tokens=20, eos_id=eos)
    for tokens_free, tokens_stopped, prompt, lp in zip(free, stopped, prompts, logprobs):
        cut = tokens_free.index(eos) if eos in tokens_free else len(tokens_free)
        assert tokens_stopped == tokens_free[:cut]
        assert len(lp) == len(prompt) - 1 + len(tokens_stopped)
    assert len(stopped[1]) <= 4


def test_a_prompt_generates_the_same_alone_and_in_a_batch(model):
    prompts = random_prompts(PROMPT_LENGTHS, model.args.vocab_size, seed=7)
    batched, _ = generate(prompts, model, max_tokens=2 * WINDOW, chunk_size=4)
    for prompt, tokens in zip(prompts, batched):
        alone, _ = generate([prompt], model, max_tokens=2 * WINDOW, chunk_size=4)
        assert alone[0] == tokens


def test_sampling_is_reproducible_with_a_seed(model):
    prompts = random_prompts([5, 9], model.args.vocab_size, seed=8)
    kwargs = dict(max_tokens=30, temperature=1.0, top_p=0.9, top_k=20)
    first, _ = generate(prompts, model, seed=123, **kwargs)
    again, _ = generate(prompts, model, seed=123, **kwargs)
    other, _ = generate(prompts, model, seed=124, **kwargs)
    assert first == again
    assert first != other


def test_greedy_generation_matches_transformers(model_pair):
    ours, hf, args = model_pair
    prompts = random_prompts([2 * WINDOW + 3, 5, 1], args.vocab_size, seed=9)
    generated, _ = generate(prompts, ours, max_tokens=3 * WINDOW, eos_id=2, chunk_size=WINDOW)
    for prompt, tokens in zip(prompts, generated):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=3 * WINDOW,
                do_sample=False,
                pad_token_id=0,
            )
        expected = out[0, len(prompt) :].tolist()
        if 2 in expected:
            expected = expected[: expected.index(2)]
        assert tokens == expected


def test_no_window_model_generates_like_its_uncached_forward():
    model = random_model(tiny_args(sliding_window=None), seed=11)
    prompts = random_prompts([13, 4], model.args.vocab_size, seed=10)
    generated, logprobs = generate(prompts, model, max_tokens=25, chunk_size=5)
    full = [p + g for p, g in zip(prompts, generated)]
    for got, expected in zip(logprobs, score(model, full)):
        assert got == pytest.approx(expected, abs=1e-4)


def test_prompt_chunks_worked_example():
    """The example in prompt_chunks' docstring, a..g as 1..7."""
    from mixtral_infer.generation.generate import prompt_chunks

    chunks = [(s, n, ids.tolist(), e) for s, n, ids, e in prompt_chunks([[1, 2, 3, 4, 5], [6, 7]], 2, torch.device("cpu"))]
    assert chunks == [(0, [2, 2], [1, 2, 6, 7], [1]), (2, [2, 0], [3, 4], []), (4, [1, 0], [5], [0])]


@torch.no_grad()
def test_both_prefills_give_the_same_last_logits_and_the_scores_of_a_cacheless_pass(model):
    from mixtral_infer.generation.generate import prefill, prefill_with_logprobs

    prompts = random_prompts(PROMPT_LENGTHS, model.args.vocab_size, seed=9)
    caches = [model.make_cache(len(prompts)) for _ in range(2)]
    last = prefill(model, caches[0], prompts, chunk_size=5)
    last_too, logprobs = prefill_with_logprobs(model, caches[1], prompts, chunk_size=5)
    torch.testing.assert_close(last, last_too, atol=1e-5, rtol=1e-5)
    assert caches[0].tokens_seen == caches[1].tokens_seen == [len(p) for p in prompts]
    for ours, expected in zip(logprobs, score(model, prompts)):
        assert ours == pytest.approx(expected, abs=1e-4)
    full = [model(torch.tensor(p), [len(p)])[-1] for p in prompts]
    torch.testing.assert_close(last, torch.stack(full), atol=1e-4, rtol=1e-4)


def test_a_cache_cut_short_counts_only_what_it_holds():
    """Interrupted calls leave a cache that a later call reads correctly, or refuses.

    - Static decoding whose ``on_token`` raises counts what its steps fed, as the eager loop does
      (it kept the prompt's count, and the next call read stale slots: logits off by 7.6).
    - A prompt chunk cut short between layers marks the cache damaged (its early layers overwrote
      slots the chunk still needed, once the window wrapped): refused until its sequences start again.
    - ``Conversation`` then reads its history again and answers as if nothing had happened."""
    from mixtral_infer.errors import GenerationError
    from mixtral_infer.generation.chat import Conversation

    model = random_model(tiny_args(moe=False, max_batch_size=1), seed=3)
    prompt = random_prompts([9], model.args.vocab_size, seed=4)[0]
    more = random_prompts([3], model.args.vocab_size, seed=5)[0]

    def stop_at(n, got):
        def on_token(_, token):
            got.append(token)
            if len(got) == n:
                raise KeyboardInterrupt
        return on_token

    for decode in ("eager", "static"):
        cache, got = model.make_cache(1), []
        with pytest.raises(KeyboardInterrupt):
            generate([prompt], model, max_tokens=3 * WINDOW, cache=cache, on_token=stop_at(2 * WINDOW, got), decode=decode)
        assert cache.tokens_seen == [len(prompt) + len(got) - 1], decode  # every answer token but the last
        _, continued = generate([got[-1:] + more], model, max_tokens=0, cache=cache, decode="eager")
        _, whole = generate([prompt + got + more], model, max_tokens=0, decode="eager")
        torch.testing.assert_close(torch.tensor(continued[0]), torch.tensor(whole[0][-len(continued[0]):]), atol=1e-4, rtol=0)

    ids = torch.tensor(random_prompts([3 * WINDOW], model.args.vocab_size, seed=6)[0])
    cache = model.make_cache(1)
    model(ids[: 2 * WINDOW], [2 * WINDOW], cache=cache)  # the window has wrapped
    hook = model.layers["1"].register_forward_pre_hook(lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        model(ids[2 * WINDOW :], [WINDOW], cache=cache)
    hook.remove()
    assert cache.damaged
    with pytest.raises(GenerationError, match="the cache was left half-written by an interrupted prompt chunk"):
        model(ids[2 * WINDOW :], [WINDOW], cache=cache)  # it gave logits off by 10

    shipped, tokenizer = load_model("tiny-mistral", dtype=torch.float32), Tokenizer.from_folder("tiny-mistral")
    talk = Conversation(shipped, tokenizer, instruct=True, max_tokens=5)
    fresh = Conversation(shipped, tokenizer, instruct=True, max_tokens=5)
    first = "In the beginning " * 4
    talk.reply(first), fresh.reply(first)
    talk.cache.damaged = True  # as a Ctrl-C in its next prompt would leave it
    assert talk.reply("And the earth").text == fresh.reply("And the earth").text
