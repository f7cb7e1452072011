"""The per-row sampler: the worked example, the greedy limit, and the distribution it draws from."""

from __future__ import annotations

import pytest
import torch

from mixtral_infer.sampling import Sampling, sample, sample_next, token_logprobs
from mixtral_infer.generation.sampling_params import effective_temperature


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
    assert sample(logits, rows, torch.tensor([0.95, 0.95])).tolist()[0] == 0  # top-1 of a tie: argmax's, the first
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


def test_top_k_1_and_the_smallest_top_p_are_greedy_even_on_ties():
    """Tied logits (bfloat16 makes them) are ranked in index order, as ``argmax`` takes them, so
    top_k=1 is greedy (it took the later token of a tie); a top_p below float32's smallest number
    (0 in float32) keeps the top token, where it kept none and the draw fell on the least likely."""
    logits = torch.tensor([[0.0, 4.875, -1.0, 4.875, 2.0]])  # tokens 1 and 3 tie
    for uniform in (0.0, 0.5, 0.999):
        assert sample(logits, settings(1, 5, 1.0, top_k=1), torch.tensor([uniform])).tolist() == [1]
        assert sample(logits, settings(1, 5, 1.0, top_p=1e-50), torch.tensor([uniform])).tolist() == [1]
    assert sample(logits, settings(1, 5, 0.0), None).tolist() == [1]


def test_a_temperature_past_float32_s_range_samples_uniformly_as_inf_does():
    """1e300 overflowed float32 in a traceback; it is the uniform limit, as inf."""
    logits = torch.tensor([[5.0, 0.0, -5.0, 1.0]])
    assert settings(1, 4, 1e300).temperature.tolist() == [float("inf")]
    assert effective_temperature(1e300) == float("inf") and effective_temperature(3e38) == 3e38  # the server's
    for uniform in (0.1, 0.3, 0.6, 0.9):  # every token equally likely: the draw picks rank floor(4u)
        hot, inf = (sample(logits, settings(1, 4, t), torch.tensor([uniform])) for t in (1e300, float("inf")))
        assert hot.tolist() == inf.tolist() == [int(4 * uniform)]
