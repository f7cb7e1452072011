"""Speculative decoding (generation.speculative): the tokens of plain decoding (greedy), the model's
distribution (sampling), the cache stepped back exactly after rejected guesses past the window."""

from __future__ import annotations

import doctest
import re

import pytest
import torch
from conftest import WINDOW, random_model, tiny_args

import mixtral_infer.generation.speculative as speculative
import mixtral_infer.model.cache as cache_module
from mixtral_infer import generate
from mixtral_infer.errors import GenerationError
from mixtral_infer.generation.speculative import DraftModel, PromptLookup, SpeculativeStats, accept
from mixtral_infer.model.cache import SlackSlots

K = 4


def test_worked_examples():
    assert doctest.testmod(speculative).failed == 0
    assert doctest.run_docstring_examples(cache_module.can_cut_back, {"can_cut_back": cache_module.can_cut_back}) is None


class Oracle:
    """A proposer that knows plain decoding's answer and guesses right ``right[row]`` times, then wrong:
    each row accepts the number of guesses the test chose."""

    adaptive = False

    def __init__(self, prompts, answers, right, vocab):
        self.prompts, self.answers, self.right, self.vocab = prompts, answers, right, vocab
        self.stats = SpeculativeStats()

    def begin(self, *args, **kwargs):
        pass

    def propose(self, rows, texts, ks, sampling, generators):
        guesses = []
        for row, text, k in zip(rows, texts, ks):
            done = len(text) - len(self.prompts[row])
            truth = self.answers[row][done : done + k]
            wrong = [(t + 1) % self.vocab for t in truth]
            n = min(self.right[row], len(truth))
            guesses.append(truth[:n] + wrong[n:])
        return guesses, [None] * len(guesses)


def prompts_past_window():
    g = torch.Generator().manual_seed(3)
    lengths = [WINDOW + 3, 5, 2 * WINDOW + 1]  # two rows start wrapped, one wraps while decoding
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("moe", [False, True])
def test_rows_accepting_different_counts_give_plain_tokens(decode, moe):
    """Row 0 rejects every guess (k back after the wrap), row 1 accepts all k, row 2 accepts 2: the
    tokens and log-probabilities are plain decoding's, and the cache ends as plain decoding's."""
    model = random_model(tiny_args(moe=moe))
    prompts = prompts_past_window()
    plain_cache = model.make_cache(3, max_seqlen=64)
    plain, plain_lp = generate(prompts, model, max_tokens=3 * WINDOW, decode=decode, cache=plain_cache)
    oracle = Oracle(prompts, plain, right=[0, K, 2], vocab=128)
    spec_cache = model.make_cache(3, max_seqlen=64)
    spec, spec_lp = generate(prompts, model, max_tokens=3 * WINDOW, decode=decode, cache=spec_cache, draft=oracle, speculative_tokens=K)
    assert spec == plain
    for a, b in zip(spec_lp, plain_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    assert spec_cache.tokens_seen == plain_cache.tokens_seen
    assert spec_cache.slack is None  # the slack was the call's own
    # The rows hold what plain decoding left: the next token after each is the same.
    nxt = [[a[-1]] for a in plain]
    torch.testing.assert_close(
        generate(nxt, model, max_tokens=2, cache=spec_cache, prompt_logprobs=False)[1],
        generate(nxt, model, max_tokens=2, cache=plain_cache, prompt_logprobs=False)[1],
        atol=1e-4, rtol=0,
    )
    stats = oracle.stats
    assert stats.proposed > 0 and 0 < stats.acceptance_rate < 1
    assert stats.emitted == sum(len(a) for a in plain) - 3  # every token but each row's first (from the prompt)
    assert stats.tokens_per_step > 1


def test_prompt_lookup_and_draft_model_give_plain_tokens_with_grammar_free_shaping():
    """Prompt lookup on a repetitive prompt, and a draft model (another random model, and the model itself),
    with penalties, bias and min_tokens shaping every checked position, and an EOS."""
    model = random_model(tiny_args())
    other = random_model(tiny_args(moe=False), seed=5)
    prompts = [[1, 2, 3, 4, 5, 6, 7] * 3, [9, 8, 7, 9, 8, 7, 9, 8]]
    shaping = dict(repetition_penalty=1.2, logit_bias={5: 1.5}, min_tokens=3)
    plain, plain_lp = generate(prompts, model, max_tokens=20, eos_id=11, **shaping)
    for draft in ["ngram", DraftModel(other), DraftModel(model)]:
        spec, spec_lp = generate(prompts, model, max_tokens=20, eos_id=11, draft=draft, **shaping)
        assert spec == plain, draft
        for a, b in zip(spec_lp, plain_lp):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)
    assert draft.stats.proposed > 0 and other_stats(draft) < 1  # it guesses unshaped: some guesses fail
    self_draft = DraftModel(model)  # the model drafting for itself, unshaped: every guess is right
    assert generate(prompts, model, max_tokens=20, draft=self_draft)[0] == generate(prompts, model, max_tokens=20)[0]
    assert self_draft.stats.acceptance_rate == 1.0 and self_draft.stats.tokens_per_step > 2


def other_stats(draft) -> float:
    return draft.stats.acceptance_rate


def test_grammar_and_stop_strings_apply_to_every_checked_position():
    """The shipped tiny-mixtral in float32 with its tokenizer: a regex, a stop string, prompt lookup on
    a text that repeats: the same text as plain decoding."""
    import os

    import mixtral_infer
    from mixtral_infer import Tokenizer, load_model

    folder = os.path.join(os.path.dirname(mixtral_infer.__file__), "shipped", "tiny-mixtral")
    model = load_model(folder, max_batch_size=2, dtype=torch.float32)
    tokenizer = Tokenizer.from_folder(folder)
    verse = "In the beginning God created the heaven and the earth. "
    prompts = [tokenizer.encode(verse * 3, bos=True), tokenizer.encode(verse, bos=True)]
    for shaping in (dict(regex="[a-z ]{1,60}"), dict(stop=["the earth"]), dict(choices=["heaven", "the earth and"])):
        common = dict(max_tokens=24, eos_id=tokenizer.eos_id, tokenizer=tokenizer, **shaping)
        plain, _ = generate(prompts, model, **common)
        assert generate(prompts, model, draft="ngram", **common)[0] == plain, shaping


def test_quantized_model_gives_its_own_plain_tokens():
    from mixtral_infer.formats.quantizing import quantize_model

    model = random_model(tiny_args())
    quantize_model(model, "int8")
    prompts = prompts_past_window()
    plain, _ = generate(prompts, model, max_tokens=20)
    spec, _ = generate(prompts, model, max_tokens=20, draft="ngram", speculative_tokens=3)
    assert spec == plain


def test_sampling_reproduces_with_a_seed_and_a_self_draft_accepts_everything():
    model = random_model(tiny_args())
    prompts = prompts_past_window()
    params = dict(max_tokens=16, temperature=0.8, top_k=20, seed=7)
    draft = DraftModel(model)
    first, _ = generate(prompts, model, draft=draft, **params)
    again, _ = generate(prompts, model, draft=draft, **params)
    assert first == again
    assert all(len(a) == 16 for a in first)
    # q = p: every guess is accepted (min(1, p/q) = 1), up to float rounding of the two passes' logits
    assert draft.stats.acceptance_rate > 0.95


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def empirical(choose, p, q, trials=20000, seed=0) -> torch.Tensor:
    """The distribution of the token a position gives: the guess drawn from q (None: certain, token 1)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros_like(p)
    for _ in range(trials):
        guess = 1 if q is None else int(torch.multinomial(q, 1, generator=g))
        token, _ = choose(p, guess, q, g)
        counts[token] += 1
    return counts / trials


def uncorrected(p, guess, q, generator):
    """``accept`` without the correction: a rejected guess is replaced by a draw from p itself."""
    q_guess = 1.0 if q is None else float(q[guess])
    if float(torch.rand(1, generator=generator)) * q_guess < float(p[guess]):
        return guess, True
    return speculative.draw(p, generator, p.device), False


@pytest.mark.parametrize("certain", [False, True])
def test_rejection_sampling_gives_the_models_distribution(certain):
    """Over 20000 draws at a vocabulary of 5 the tokens follow p (total variation < 0.015, about 4
    standard errors), whatever q; removing the correction (resampling from p) fails the same bound."""
    p = torch.tensor([0.05, 0.15, 0.4, 0.3, 0.1])
    q = None if certain else torch.tensor([0.3, 0.4, 0.05, 0.05, 0.2])
    assert total_variation(empirical(accept, p, q), p) < 0.015
    assert total_variation(empirical(uncorrected, p, q), p) > 0.05


def test_worked_example_of_accept():
    """p = [0.5, 0.3, 0.2], guess 1 from q = [0.1, 0.6, 0.3]: accepted half the time (0.3 / 0.6), else
    token 0, the only token p holds more of than q."""
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.1, 0.6, 0.3])
    g = torch.Generator().manual_seed(1)
    tokens = [accept(p, 1, q, g)[0] for _ in range(4000)]
    assert abs(tokens.count(1) / 4000 - 0.5) < 0.03
    assert set(tokens) == {0, 1}


def test_slack_steps_back_exactly_k_after_a_wrap_and_refuses_k_plus_1():
    model = random_model(tiny_args(moe=False))
    cache = model.make_cache(1, max_seqlen=64)
    cache.start_sequences(1)
    slack = SlackSlots(cache, K)
    tokens = torch.randint(1, 128, (2 * WINDOW + K + 1,), generator=torch.Generator().manual_seed(0))
    seen = 2 * WINDOW
    model(tokens[:seen], [seen], cache)
    slack.save([K + 1])
    model(tokens[seen : seen + K + 1], [K + 1], cache)  # the last token and K guesses
    assert not slack.can_cut_back(0, seen)  # K + 1 back: position seen - W is gone
    with pytest.raises(GenerationError, match="keeps positions"):
        slack.cut_back(0, seen)
    slack.cut_back(0, seen + 1)  # K back: every guess rejected
    after = model(tokens[seen + 1 : seen + 2], [1], cache)
    fresh = model.make_cache(1, max_seqlen=64)
    fresh.start_sequences(1)
    model(tokens[: seen + 1], [seen + 1], fresh)
    torch.testing.assert_close(after, model(tokens[seen + 1 : seen + 2], [1], fresh))


def test_bad_settings_are_refused_before_work():
    model = random_model(tiny_args())
    with pytest.raises(GenerationError, match="speculative_tokens needs draft"):
        generate([[1, 2]], model, max_tokens=2, speculative_tokens=3)
    with pytest.raises(GenerationError, match="from 1 to 64"):
        generate([[1, 2]], model, max_tokens=2, draft="ngram", speculative_tokens=0)
    with pytest.raises(GenerationError, match="'ngram'"):
        generate([[1, 2]], model, max_tokens=2, draft="ngrams")
    other = random_model(tiny_args(moe=False).__class__(**{**tiny_args(moe=False).__dict__, "vocab_size": 64}))
    with pytest.raises(GenerationError, match="the model's tokenizer"):
        generate([[1, 2]], model, max_tokens=2, draft=other)
    with pytest.raises(GenerationError, match="from 1 to 64"):
        from mixtral_infer import LLM

        LLM("tiny-mixtral", draft_model="tiny-mistral", speculative_tokens=0)
    with pytest.raises(GenerationError, match="True or False"):
        LLM("tiny-mixtral", speculative_ngram="yes")


@pytest.mark.parametrize("max_tokens, k", [(1, 4), (2, 4), (6, 4), (20, WINDOW), (20, 2 * WINDOW)])
def test_static_verify_takes_as_many_guesses_as_the_cache_holds(max_tokens, k):
    """A fresh cache holds the prompt and max_tokens, fewer slots than the window for a short call:
    the static verify step checks fewer guesses there (it writes k + 1 tokens at once), the eager pass
    any number; both give plain decoding's tokens."""
    model = random_model(tiny_args())
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5]]
    plain, _ = generate(prompts, model, max_tokens=max_tokens)
    for decode in ("static", "eager"):
        assert generate(prompts, model, max_tokens=max_tokens, draft="ngram", speculative_tokens=k, decode=decode)[0] == plain


def test_compiled_verify_step_gives_plain_tokens():
    """The verify step built by the step compiler (AOTInductor does not take the chunk: torch.compile)."""
    model = random_model(tiny_args(moe=False))
    prompts = [[1, 2, 3, 4, 5, 6, 7] * 3, prompts_past_window()[1]]
    plain, plain_lp = generate(prompts, model, max_tokens=20)
    spec, spec_lp = generate(prompts, model, max_tokens=20, decode="compiled", draft="ngram", speculative_tokens=3)
    assert spec == plain
    for a, b in zip(spec_lp, plain_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def test_front_doors_give_plain_text_and_say_what_speculation_gained(capsys, monkeypatch):
    """demo and interactive (--draft-model, --speculative-ngram), LLM (draft_model=, speculative_ngram=)
    and Conversation: the text of plain greedy decoding, and the stats line / metrics count the guesses."""
    from mixtral_infer import LLM
    from mixtral_infer.cli import commands

    common = dict(max_tokens=24, temperature=0, dtype="float32", prompt=["In the beginning God created", "And God said"])
    commands.demo(**common)
    plain = capsys.readouterr()
    for flags in (dict(draft_model="tiny-mistral"), dict(speculative_ngram=True, speculative_tokens=3)):
        commands.demo(**common, **flags)
        spec = capsys.readouterr()
        assert spec.out == plain.out, flags
        assert re.search(r"tokens/s\); speculation: \d+% of \d+ guesses accepted, [\d.]+ tokens per step", spec.err), spec.err

    lines = iter(["In the beginning", "And God said", None])
    monkeypatch.setattr(commands, "read_line", lambda prompt: next(lines))
    commands.interactive(max_tokens=12, temperature=0, dtype="float32", instruct=True, draft_model="tiny-mistral")
    stats = [line for line in capsys.readouterr().err.splitlines() if "tokens/s" in line]
    assert len(stats) == 2 and all("guesses accepted" in line for line in stats), stats

    llm = LLM("tiny-mixtral", dtype=torch.float32)
    spec_llm = LLM("tiny-mixtral", dtype=torch.float32, speculative_ngram=True)
    prompts = ["In the beginning God created the heaven and the earth. In the beginning", "And God said"]
    plain_out = llm.generate(prompts, max_tokens=30, temperature=0)
    spec_out = spec_llm.generate(prompts, max_tokens=30, temperature=0)
    assert [o.text for o in spec_out] == [o.text for o in plain_out]
    assert plain_out[0].metrics == {} and spec_out[0].metrics["guesses"] > 0
    assert spec_out[0].metrics["tokens_per_step"] >= 1
    with pytest.raises(GenerationError, match="not both"):
        LLM("tiny-mixtral", draft_model="tiny-mistral", speculative_ngram=True)


def test_command_line_refuses_bad_speculation_options_before_loading():
    from mixtral_infer.cli.commands import check_speculative_options

    for args, message in (
        (("tiny-mistral", True, None), "not both"),
        ((None, False, 3), "needs --draft-model"),
        ((None, True, 0), "from 1 to 64"),
        (("no/such/folder", False, None), "--draft-model"),
        ((None, True, None, 2), "whole model in one process"),
    ):
        with pytest.raises(GenerationError, match=message):
            check_speculative_options(*args)
