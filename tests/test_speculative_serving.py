"""Speculative decoding in the serving engine: each request's tokens are those it gets alone without
speculation, at any acceptance; the engine stops speculating where it does not pay."""

from __future__ import annotations

import pytest
import torch

from mixtral_infer import Tokenizer, generate, load_model
from mixtral_infer.generation.speculative import SpeculativeStats
from mixtral_infer.serve.engine import Engine, Finished, RequestSettings, TokenEvent
from mixtral_infer.serve.metrics import ServeMetrics
from mixtral_infer.serve.speculation import EXPLORE_FIRST, EXPLORE_MOST, SpeculationPolicy
from mixtral_infer.structured.grammar import Constraint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VERSE = "In the beginning God created the heaven and the earth. And the earth was without form, and void. "


@pytest.fixture(scope="module")
def models():
    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    draft = load_model("tiny-mistral", dtype=torch.float32, device="cpu")
    return model, draft, Tokenizer.from_folder("tiny-mixtral")


def prompts(tokenizer):
    return [tokenizer.encode(VERSE * 2), tokenizer.encode("And it came to pass"), tokenizer.encode(VERSE + "In the")]


def serve(engine, requests):
    events = {}
    for key, (prompt, settings) in enumerate(requests):
        engine.submit(prompt, settings, lambda event, key=key: events.setdefault(key, []).append(event))
    while engine.step():
        pass
    return [[e.token for e in events[key] if isinstance(e, TokenEvent)] for key in range(len(requests))], events


def alone(model, tokenizer, prompt, max_tokens):
    return generate([prompt], model, max_tokens=max_tokens, eos_id=tokenizer.eos_id, prompt_logprobs=False)[0][0]


@pytest.mark.parametrize("draft, decode", [("ngram", "eager"), ("model", "eager"), ("ngram", "static")])
def test_requests_get_their_tokens_alone_past_the_window(models, draft, decode):
    """Verified by Transformer.forward (eager) or the fixed-shape verify step (static)."""
    model, draft_model, tokenizer = models
    metrics = ServeMetrics(3)
    engine = Engine(model, tokenizer, 3, decode=decode, draft=draft_model if draft == "model" else "ngram",
                    speculative_tokens=4, metrics=metrics)  # fmt: skip
    assert engine._verifies_static() == (decode == "static")
    engine.policy.wanted = lambda rows: True  # every decode step speculates
    requests = [(p, RequestSettings(max_tokens=45, logprobs=0)) for p in prompts(tokenizer)]  # the window is 32
    got, events = serve(engine, requests)
    assert got == [alone(model, tokenizer, p, 45) for p, _ in requests]
    stats = engine.stats()
    assert stats["guesses"] > 0 and stats["accepted"] > 0 and stats["tokens_per_step"] > 1
    exposition = metrics.exposition().decode()
    assert f"mixtral_infer_speculative_accepted_tokens_total {float(stats['accepted'])}" in exposition
    assert "mixtral_infer_speculative_acceptance_rate" in exposition


def test_opted_out_request_grammar_and_sampling(models):
    """A request that opts out checks no guess; a regex applies to every checked position; a sampled
    request with a seed gives the same tokens twice."""
    model, _, tokenizer = models
    regex = Constraint("regex", "[a-z ]{1,80}")

    def requests():
        p = prompts(tokenizer)
        return [
            (p[0], RequestSettings(max_tokens=30, speculative=False)),
            (p[2], RequestSettings(max_tokens=30, constraint=regex)),
            (p[1], RequestSettings(max_tokens=30, temperature=0.8, top_k=20, seed=3)),
        ]

    plain, _ = serve(Engine(model, tokenizer, 3, decode="eager"), requests())
    engine = Engine(model, tokenizer, 3, decode="eager", draft="ngram")
    engine.policy.wanted = lambda rows: True
    spec, _ = serve(engine, requests())
    assert spec[:2] == plain[:2]
    again = Engine(model, tokenizer, 3, decode="eager", draft="ngram")
    again.policy.wanted = lambda rows: True
    assert serve(again, requests())[0][2] == spec[2]
    assert engine.stats()["guesses"] > 0


def test_policy_worked_example():
    """The module docstring's numbers: at 16 rows 2.0 * 40 ms < 90 ms, plain; at 1 row 2.0 * 12 > 15, speculative."""
    policy = SpeculationPolicy()
    for rows, plain, speculative in ((16, 0.040, 0.090), (1, 0.012, 0.015)):
        for _ in range(3):  # the first of each kind is left out
            policy.record_plain(rows, plain)
            policy.record_speculative(rows, speculative, 2.0)
    assert not policy.pays(16) and policy.pays(1)
    choices = [policy.wanted(16) for _ in range(EXPLORE_FIRST + 2 * EXPLORE_FIRST + 4 * EXPLORE_FIRST)]
    explored = [i for i, speculates in enumerate(choices) if speculates]  # the other kind, ever more rarely
    assert explored == [EXPLORE_FIRST - 1, 3 * EXPLORE_FIRST - 1, 7 * EXPLORE_FIRST - 1]
    assert policy.every[16] == 8 * EXPLORE_FIRST <= EXPLORE_MOST
    assert policy.wanted(9) is False  # 9 rows count as 16


def test_engine_turns_speculation_off_where_it_does_not_pay(models):
    """With every step's cost read as a verify pass twice a plain step (the clock is the test's, not
    the busy machine's) and no guess ever right, the engine measures both, then runs plain steps."""
    model, _, tokenizer = models

    class Wrong:
        adaptive, stats = False, SpeculativeStats()

        def begin(self, *args, **kwargs):
            pass

        def propose(self, rows, texts, ks, sampling, generators):
            return [[1] * k for k in ks], [None] * len(rows)

    engine = Engine(model, tokenizer, 2, decode="eager", draft=Wrong(), speculative_tokens=3)
    policy = engine.policy
    plain, speculative = policy.record_plain, policy.record_speculative
    policy.record_plain = lambda rows, seconds: plain(rows, 0.010)
    policy.record_speculative = lambda rows, seconds, gain: speculative(rows, 0.020, gain)
    got, _ = serve(engine, [(prompts(tokenizer)[1], RequestSettings(max_tokens=60))])
    assert got[0] == alone(model, tokenizer, prompts(tokenizer)[1], 60)
    assert policy.gain[1] == 1.0 and not policy.pays(1)
    assert engine.stats()["speculative_steps"] < 10  # measured, then explored after EXPLORE_FIRST steps


def test_prefix_reuse_and_n_choices_with_speculation(models):
    """A next turn continues the row a speculating request left (its ids cut back with its cache), and
    a second choice of a prompt (``follows``) samples from a copy of its row: each as it is alone."""
    model, _, tokenizer = models
    engine = Engine(model, tokenizer, 3, decode="eager", draft="ngram", slack=8)
    engine.policy.wanted = lambda rows: True
    first = prompts(tokenizer)[0]
    [answer], _ = serve(engine, [(first, RequestSettings(max_tokens=40))])
    assert engine.row_states[0].ids == first + answer[:-1] or any(s.ids == first + answer[:-1] for s in engine.row_states)
    follow_up = first + answer + tokenizer.encode("And God said", bos=False)
    [second], _ = serve(engine, [(follow_up, RequestSettings(max_tokens=30))])
    assert engine.stats()["prefix_hits"] == 1 and engine.stats()["reused_tokens"] == len(first) + len(answer) - 1
    assert second == alone(model, tokenizer, follow_up, 30)

    events = {}
    settings = [RequestSettings(max_tokens=20, temperature=0.7, seed=s) for s in (1, 2)]
    leader = engine.submit(first, settings[0], lambda e: events.setdefault(0, []).append(e))
    engine.submit(first, settings[1], lambda e: events.setdefault(1, []).append(e), follows=leader)
    while engine.step():
        pass
    choices = [[e.token for e in events[i] if isinstance(e, TokenEvent)] for i in (0, 1)]
    assert all(len(c) == 20 for c in choices) and choices[0] != choices[1]
    assert all(isinstance(events[i][-1], Finished) for i in (0, 1))
