"""GemLite's CUDA products (``quant/gemlite_cuda.py``) as far as a CPU can check them: the weights
handed to GemLite stand, in its format ``(W_q - zeros) * scales``, for exactly the weight the
reference multiplies by; which weights it takes; which products ``quantized_linear`` sends to it;
that serving counts its layout. Its kernels themselves run in ``tests/test_cuda.py`` on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import random_model, tiny_args

from mixtral_infer.quant import gemlite_cuda, kernels
from mixtral_infer.quant.model import quantize_model
from mixtral_infer.quant.weights import QuantizedParameter, QuantizedWeight, QuantScheme, quantize
from mixtral_infer.serve.sizing import weight_bytes


@pytest.mark.parametrize("scheme", ["int8", "int4", "int4-128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemlites_format_stands_for_the_reference_weight_bit_for_bit(scheme, dtype):
    g = torch.Generator().manual_seed(1)
    weight = quantize(torch.randn(96, 256, generator=g), QuantScheme.parse(scheme), dtype)
    W_q, scales, zeros, bits, group_size = gemlite_cuda.arguments(weight)
    assert W_q.shape == (96, 256) and scales.shape == (96, 256 // group_size)
    if scheme == "int8":
        assert (bits, zeros, group_size, W_q.dtype) == (8, None, 256, torch.int8)
        assert W_q.data_ptr() == weight.values.data_ptr()  # read in place, no copy
    else:
        assert (bits, zeros, W_q.dtype) == (4, 8, torch.uint8) and int(W_q.min()) >= 0 and int(W_q.max()) <= 15
    assert torch.equal(gemlite_cuda.dequantize(W_q, scales, zeros, group_size, dtype), weight.dequantize(dtype))


def test_the_worked_example_of_the_docstring():
    """Byte 0x8F holds inputs [7, 0] (codes 15 and 8); with scale 0.5 GemLite gets codes [15, 8],
    zeros 8, and the weights 3.5 and 0."""
    values = torch.full((1, 16), 0x88, dtype=torch.uint8)  # 32 inputs of code 8: zero
    values[0, 0] = 0x8F
    weight = QuantizedWeight(QuantScheme("int4", 32), values, torch.tensor([[0.5]], dtype=torch.bfloat16), 32)
    W_q, scales, zeros, _, group_size = gemlite_cuda.arguments(weight)
    assert W_q[0, :3].tolist() == [15, 8, 8] and zeros == 8
    dense = gemlite_cuda.dequantize(W_q, scales, zeros, group_size, torch.float32)
    assert dense[0, :2].tolist() == [3.5, 0.0] and dense[0, 2:].abs().sum() == 0


def test_which_weights_gemlite_takes():
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(64, 96, generator=g)
    assert gemlite_cuda.supports(quantize(dense, QuantScheme.parse("int8"), torch.bfloat16))
    assert gemlite_cuda.supports(quantize(dense, QuantScheme.parse("int4"), torch.float16))
    assert not gemlite_cuda.supports(quantize(dense, QuantScheme.parse("nf4-32"), torch.bfloat16))  # not evenly spaced
    assert not gemlite_cuda.supports(quantize(dense, QuantScheme.parse("int8"), torch.float32))  # 16-bit only
    experts = quantize(torch.randn(4, 64, 96, generator=g), QuantScheme.parse("int8"), torch.bfloat16)
    assert not gemlite_cuda.supports(experts)  # one expert of them would be a gathered copy
    off_32 = quantize(torch.randn(64, 48, generator=g), QuantScheme.parse("int8"), torch.bfloat16)
    assert not gemlite_cuda.supports(off_32)  # GemLite's inputs: a multiple of 32


def test_no_gemlite_without_cuda_so_cpu_weights_keep_their_layouts():
    assert gemlite_cuda.library() is None  # this machine: no GPU
    model = quantize_model(random_model(tiny_args(moe=False)).to(torch.bfloat16), "int4")
    held = [m for m in model.modules() if isinstance(m, QuantizedParameter)]
    assert held and all(m.gemlite is None for m in held)
    assert kernels.int4_layout(held[0]) == "cpu"


class StandIn:
    """A GemLite product's place, on CPU: what ``quantized_linear`` hands it is recorded, and the
    reference's product returned, so the routing can be checked where GemLite cannot run."""

    def __init__(self, weight: QuantizedWeight):
        self.weight, self.calls = weight, []
        words = torch.zeros(weight.in_features // 8, weight.shape[0], dtype=torch.int32)  # int4's (IN/8, OUT)
        self.tensors = (words,)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(x.shape))
        return kernels.reference_linear(x, self.weight)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_linear_hands_gemlite_fewer_than_its_rows_in_its_dtype(scheme):
    weight = quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(2)), QuantScheme.parse(scheme),
                      torch.bfloat16)  # fmt: skip
    weight.gemlite = StandIn(weight)
    for rows in (1, 4, gemlite_cuda.ROWS - 1):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        assert torch.equal(kernels.quantized_linear(x, weight), kernels.reference_linear(x, weight))
    assert weight.gemlite.calls == [(1, 96), (4, 96), (gemlite_cuda.ROWS - 1, 96)]
    kernels.quantized_linear(torch.randn(gemlite_cuda.ROWS, 96, dtype=torch.bfloat16), weight)  # a prompt chunk
    kernels.quantized_linear(torch.randn(1, 96), weight)  # float32 activations: the reference
    assert len(weight.gemlite.calls) == 3


def test_serving_counts_gemlites_int4_words_among_the_weights():
    model = quantize_model(random_model(tiny_args(moe=False)).to(torch.bfloat16), "int4")
    before = weight_bytes(model)
    wq = model.layers["0"].attention.wq.weight
    wq.gemlite = StandIn(wq)
    assert weight_bytes(model) == before + 64 * 64 // 2  # (IN/8, OUT) int32 words: half a byte a weight


def test_a_weight_gemlite_cannot_pack_is_logged_and_left_to_pytorchs_kernels(monkeypatch, caplog):
    """An optional accelerator never stops a model loading: a GemLite that fails to pack a weight
    (its API moved, say) leaves one logged line and no product."""

    class Broken:
        class DType:
            BF16 = FP16 = None

        class GemLiteLinear:
            def __init__(self, *args, **kwargs):
                raise TypeError("unexpected keyword argument 'group_size'")

    monkeypatch.setattr(gemlite_cuda, "library", lambda: Broken)
    weight = quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(3)), QuantScheme.parse("int4"),
                      torch.bfloat16)  # fmt: skip
    with caplog.at_level("WARNING"):
        assert gemlite_cuda.product_or_none(weight) is None
    assert caplog.messages == [
        "GemLite could not pack a 64x96 weight of int4 (TypeError: unexpected keyword argument 'group_size'); "
        "using PyTorch's kernels"
    ]
