"""Prompt-sized float32 products by oneDNN or MKL: the same numbers (to float32's rounding), either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixtral_infer.fast import cpu_float32
from mixtral_infer.kernels.linear import linear
from mixtral_infer.tuning import Tuning


@pytest.fixture
def onednn_calls(monkeypatch):
    calls = []
    multiply = cpu_float32.onednn_linear
    monkeypatch.setattr(cpu_float32, "onednn_linear", lambda x, w: calls.append(x.shape[0]) or multiply(x, w))
    return calls


@pytest.mark.parametrize("choice", [True, False], ids=["onednn", "mkl"])
@pytest.mark.parametrize("rows", [cpu_float32.ROWS - 1, cpu_float32.ROWS, 300])
def test_linear_of_prompt_rows_equals_f_linear_by_either_library(onednn_calls, choice, rows):
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 72, generator=g), torch.randn(97, 72, generator=g)  # (M, IN), (OUT, IN)
    got = linear(x, weight, Tuning(onednn_float32=choice))
    assert got.shape == (rows, 97)
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert onednn_calls == ([rows] if choice and rows >= cpu_float32.ROWS else [])


def test_the_tuning_decides_and_none_given_is_mkl(onednn_calls):
    """Tuning.onednn_float32 (measured once per machine, fast.measured) decides; without a tuning,
    Tuning()'s default: MKL."""
    linear(torch.randn(cpu_float32.ROWS, 8), torch.randn(16, 8), Tuning(onednn_float32=True))
    linear(torch.randn(cpu_float32.ROWS, 8), torch.randn(16, 8), Tuning(onednn_float32=False))
    linear(torch.randn(cpu_float32.ROWS, 8), torch.randn(16, 8))
    assert onednn_calls == [cpu_float32.ROWS]


def test_the_measurement_takes_onednn_only_with_a_clear_margin(monkeypatch):
    for mkl, onednn, expected in ((1.0, 0.8, True), (1.0, 0.95, False), (0.5, 1.0, False)):
        times = iter([mkl, onednn])
        monkeypatch.setattr(cpu_float32, "best_seconds", lambda fn: next(times))
        assert cpu_float32.onednn_is_faster() is (expected and torch.backends.mkldnn.is_available())


def test_products_that_record_gradients_keep_f_linear(onednn_calls):
    """oneDNN's op has no backward: a research script taking gradients through the model still can."""
    tuning = Tuning(onednn_float32=True)
    weight = torch.randn(16, 8, requires_grad=True)
    linear(torch.randn(cpu_float32.ROWS, 8), weight, tuning).sum().backward()
    assert weight.grad is not None and onednn_calls == []
    with torch.no_grad():
        linear(torch.randn(cpu_float32.ROWS, 8), weight, tuning)
    assert onednn_calls == [cpu_float32.ROWS]


def test_widened_16_bit_prompts_take_the_same_choice(onednn_calls):
    """fast.cpu_upcast multiplies in float32 by the faster library too."""
    tuning = Tuning(upcast=frozenset({torch.bfloat16}), onednn_float32=True)
    x, weight = torch.randn(cpu_float32.ROWS, 8).bfloat16(), torch.randn(16, 8).bfloat16()
    got = linear(x, weight, tuning)
    assert got.dtype == torch.bfloat16 and onednn_calls == [cpu_float32.ROWS]
    torch.testing.assert_close(got, F.linear(x.float(), weight.float()).bfloat16(), atol=0, rtol=2**-7)


def test_strided_inputs_by_onednn(onednn_calls):
    """Transposed activations (the bmm path's views) and a transposed weight multiply correctly too."""
    g = torch.Generator().manual_seed(5)
    x, weight = torch.randn(40, 300, generator=g).T, torch.randn(40, 96, generator=g).T  # (M, IN), (OUT, IN) views
    got = linear(x, weight, Tuning(onednn_float32=True))
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert onednn_calls == [300]
