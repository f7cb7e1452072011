"""The per-row sampler: the worked example, the greedy limit, and the distribution it draws from."""

from __future__ import annotations

import pytest
import torch

from mixtral_infer.generation.sampling import Sampling, sample, sample_next, token_logprobs


def settings(batch, vocab, temperature, top_p=1.0, top_k=None):
    return Sampling.uniform_settings(batch, vocab, temperature, top_p, top_k)


def test_worked_example_top_k_then_inverse_transform():
    logits = torch.tensor([[0.1, 0.5, 0.3, 0.1]]).log()
    assert sample(logits, settings(1, 4, 1.0, top_k=2), torch.tensor([0.7])).tolist() == [2]
    assert sample(logits, settings(1, 4, 1.0, top_k=2), torch.tensor([0.6])).tolist() == [1]  # 0.48 < 0.5
    assert sample(logits, settings(1, 4, 1.0), torch.tensor([0.05])).tolist() == [0]  # unsorted: 0.05 < 0.1


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.tensor([[0.1, 0.5, 0.3, 0.1]]).log()
    # top_p 0.7: tokens 1 (mass before 0) and 2 (mass before 0.5) stay, token 0 (before 0.8) goes.
    drawn = {sample(logits, settings(1, 4, 1.0, top_p=0.7), torch.tensor([u])).item() for u in torch.linspace(0, 0.999, 50)}
    assert drawn == {1, 2}


def test_greedy_rows_and_tiny_temperatures_take_the_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    mixed = Sampling(
        temperature=torch.tensor([0.0, 1e-45, 1.0]), top_p=torch.ones(3), top_k=torch.full((3,), 50), greedy=False, filtered=False
    )
    tokens = sample(logits, mixed, torch.full((3,), 0.999))
    assert tokens[:2].tolist() == logits.argmax(-1)[:2].tolist()
    assert sample_next(logits, 1e-45).tolist() == logits.argmax(-1).tolist()


def test_each_row_keeps_its_own_settings():
    logits = torch.zeros(2, 10)  # uniform over 10 tokens
    rows = Sampling(torch.ones(2), torch.ones(2), torch.tensor([1, 10]), greedy=False, filtered=True)
    assert sample(logits, rows, torch.tensor([0.95, 0.95])).tolist()[1] == 9
    assert sample(logits, rows, torch.tensor([0.95, 0.95])).tolist()[0] in range(10)  # top-1 of a tie
    assert sample(logits, rows, torch.tensor([0.95, 0.0])).tolist()[1] == 0


@pytest.mark.parametrize("top_k", [None, 3])
def test_sampled_frequencies_follow_the_tempered_distribution(top_k):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    temperature, draws = 0.8, 20000
    generator = torch.Generator().manual_seed(1)
    uniform = torch.rand(draws, generator=generator)
    batch = settings(draws, 5, temperature, top_k=top_k)
    tokens = sample(logits.expand(draws, -1), batch, uniform)
    expected = torch.softmax(logits[0] / temperature, dim=-1)
    if top_k is not None:
        expected[top_k:] = 0
        expected /= expected.sum()
    observed = torch.bincount(tokens, minlength=5).float() / draws
    assert observed.tolist() == pytest.approx(expected.tolist(), abs=0.015)


def test_token_logprobs_are_the_model_log_probabilities():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    tokens = torch.tensor([0, 5, 29, 7])
    expected = torch.log_softmax(logits, -1)[torch.arange(4), tokens]
    torch.testing.assert_close(token_logprobs(logits, tokens), expected)
