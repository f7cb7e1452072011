"""Many-row 16-bit CPU products widened to float32 where that is faster (fast/cpu_upcast.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixtral_infer.fast import cpu_upcast
from mixtral_infer.fast.cpu_packed import onednn_packs, pack
from mixtral_infer.fast.cpu_upcast import UPCAST_ROWS, should_upcast, upcast_is_faster, upcast_linear
from mixtral_infer.kernels.linear import linear
from mixtral_infer.quant.weights import QuantScheme, quantize
from mixtral_infer.tuning import WIDE_DTYPES, Tuning


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_the_wide_product_is_the_exact_products_added_in_float32(dtype):
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(300, 64, generator=g).to(dtype), torch.randn(48, 64, generator=g).to(dtype)
    got = upcast_linear(x, weight)
    assert got.dtype == dtype
    exact = (x.double() @ weight.double().T).to(dtype)  # 16-bit products are exact in float32; only sums round
    assert (got.float() - exact.float()).abs().max() <= 2**-7 * exact.float().abs().max()
    assert (got.float() - F.linear(x, weight).float()).abs().max() <= 2**-7 * exact.float().abs().max()


def test_only_prefill_sized_16_bit_cpu_products_are_widened():
    wide = WIDE_DTYPES
    assert should_upcast(torch.zeros(UPCAST_ROWS, 8, dtype=torch.bfloat16), wide)
    assert not should_upcast(torch.zeros(UPCAST_ROWS - 1, 8, dtype=torch.bfloat16), wide)  # decoding reads 16 bits faster
    assert not should_upcast(torch.zeros(UPCAST_ROWS, 8), wide)  # float32 already
    assert not should_upcast(torch.zeros(UPCAST_ROWS, 8, dtype=torch.bfloat16), {torch.float16})  # the dtype's own choice
    assert not should_upcast(torch.zeros(UPCAST_ROWS, 8, dtype=torch.bfloat16))  # none given: none widened
    with pytest.raises(ValueError, match="16-bit"):
        Tuning(upcast=frozenset({torch.float32}))


@pytest.mark.parametrize("choice", [True, False])
def test_linear_takes_the_chosen_path_for_plain_packed_and_int8_weights(monkeypatch, choice):
    tuning = Tuning(upcast=WIDE_DTYPES if choice else frozenset())
    widened = []
    real = cpu_upcast.upcast_linear
    for module in ("mixtral_infer.kernels.linear.plain", "mixtral_infer.kernels.linear.packed_bf16", "mixtral_infer.kernels.linear.int8"):
        monkeypatch.setattr(f"{module}.upcast_linear", lambda x, w, onednn=False: widened.append(x.shape[0]) or real(x, w))
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(600, 64, generator=g).to(torch.bfloat16)
    expected = upcast_linear(x, weight) if choice else F.linear(x, weight)
    assert torch.equal(linear(x, weight, tuning), expected)
    packs = onednn_packs(torch.bfloat16)  # a CPU without AVX-512 holds no packed bfloat16 weights
    if packs:
        assert torch.equal(linear(x, pack(weight), tuning), expected)
    int8 = quantize(weight, QuantScheme.parse("int8"), torch.bfloat16)
    linear(x, int8, tuning)
    assert widened == ([600] * (3 if packs else 2) if choice else [])
    assert torch.equal(linear(x[:3], weight, tuning), F.linear(x[:3], weight))  # decoding-sized: never widened


def test_the_measurement_widens_only_with_a_clear_margin(monkeypatch):
    for narrow, wide, expected in ((1.0, 0.6, True), (1.0, 0.9, False), (0.3, 1.0, False)):
        times = iter([narrow, wide])
        monkeypatch.setattr(cpu_upcast, "best_seconds", lambda fn: next(times))
        assert upcast_is_faster(torch.bfloat16) is expected
