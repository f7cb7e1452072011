"""Each weight format is a module swapped in after loading (``formats.modules.use_formats``), and each
computes what the reference computes: ``F.linear(x, W)``, W the weight it stands for (dequantized for
the quantized formats). The model calls ``self.wq(x)`` whatever the module is."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import PACKS, random_model, tiny_args
from torch import nn

from mixtral_infer.fast.cpu_column_blocks import MAX_BLOCK
from mixtral_infer.formats.modules import FastAttention, FastFeedForward, FastMoeLayer, ReferenceQuantizedMoeLayer, use_formats
from mixtral_infer.kernels.linear import (
    ColumnBlocksLinear,
    Int4Linear,
    Int8Linear,
    Nf4Linear,
    PackedBf16Linear,
    PlainLinear,
    ReferenceLinear,
    W8a8Linear,
)
from mixtral_infer.kernels.linear import w8a8
from mixtral_infer.formats.packing import block_long_rows, pack_model, unpack_model
from mixtral_infer.formats.quantizing import quantize_model
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.model.transformer import Attention, FeedForward
from mixtral_infer.quant.weights import QuantScheme, quantize
from mixtral_infer.tuning import Tuning


def products(model: nn.Module, weights: dict, dtype: torch.dtype, rows: int):
    """Every linear module of ``model`` on random rows, beside ``F.linear`` of the weight it stands
    for (``weights``, by module name)."""
    generator = torch.Generator().manual_seed(rows)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            x = torch.randn(rows, module.in_features, generator=generator).to(dtype)
            yield name, module, module(x), F.linear(x, weights[name])


def stood_for(model: nn.Module, scheme: str | None, dtype: torch.dtype) -> dict:
    """The matrix each linear module of a float ``model`` stands for once formatted: its weight, or
    for a quantized scheme the dequantized integers quantizing gives it (quantizing is deterministic)."""
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            weight = module.weight.detach()
            if scheme is not None and name != "":
                kind = QuantScheme.parse(scheme)
                quantized = name.endswith(("wq", "wk", "wv", "wo", "w1", "w2", "w3")) or name == "output"
                weight = quantize(weight, kind, dtype).dequantize(dtype) if quantized else weight
            weights[name] = weight
    return weights


FORMATS = {  # how a model gets the format, its scheme, the dtype it computes in, the module its wq becomes
    "plain float32": (lambda m: m, None, torch.float32, PlainLinear),
    "oneDNN packed": (lambda m: pack_model(m, dtypes=(PACKS,)), None, PACKS, PackedBf16Linear),  # bfloat16 with AVX-512
    "int8": (lambda m: quantize_model(m, "int8"), "int8", torch.bfloat16, Int8Linear),
    "int4": (lambda m: quantize_model(m, "int4"), "int4", torch.bfloat16, Int4Linear),
    "nf4": (lambda m: quantize_model(m, "nf4"), "nf4", torch.bfloat16, Nf4Linear),
    # without fbgemm (a PyTorch not built for x86) w8a8 weights stay int8 weights, multiplied weight-only
    "w8a8": (lambda m: quantize_model(m, "w8a8"), "w8a8", torch.bfloat16, W8a8Linear if w8a8.available() else Int8Linear),
}


@pytest.mark.parametrize("rows", [1, 5, 600])  # decoding, a few sequences, a prompt (the dequantizing paths)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_module_equals_f_linear_of_its_weight(fmt, rows):
    make, scheme, dtype, expected_class = FORMATS[fmt]
    args = dataclasses.replace(tiny_args(moe=False), hidden_dim=128)  # a multiple of nf4's groups of 64
    model = random_model(args, seed=1).to(dtype)
    weights = stood_for(model, scheme, dtype)
    model = make(model)
    assert type(model.layers["0"].attention.wq) is expected_class
    assert type(model.layers["0"].attention) is FastAttention and type(model.layers["0"].feed_forward) is FastFeedForward
    # w8a8 quantizes the activations too (per row, to 127 levels): within that rounding
    tolerance = {"w8a8": 0.05}.get(fmt, 0.02 if dtype == torch.bfloat16 else 1e-5)
    for name, _, got, expected in products(model, weights, dtype, rows):
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance * expected.abs().max().item(), rtol=0,
                                   msg=lambda m, name=name: f"{fmt}: {name}: {m}")  # fmt: skip


def test_column_blocks_equal_f_linear_of_the_plain_weight(monkeypatch):
    """Rows longer than the blocks' width are kept in blocks of columns; op by op and in float32 the
    blocks' products are summed, equal to the plain product."""
    from mixtral_infer.fast import cpu_column_blocks

    monkeypatch.setattr(cpu_column_blocks, "MAX_BLOCK", 32)  # the tiny model's rows (64, 96) in blocks
    model = random_model(tiny_args(moe=False), seed=2)
    weights = stood_for(model, None, torch.float32)
    model = block_long_rows(model)
    assert type(model.layers["0"].attention.wq) is ColumnBlocksLinear and MAX_BLOCK > 32
    for name, _, got, expected in products(model, weights, torch.float32, 3):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_the_reference_keeps_the_models_own_modules_and_reads_quantized_weights_plainly():
    """``Tuning(fast=False)``: nn.Linear and the model's blocks; quantized weights through
    ``F.linear(x, dequantize(W))``, the experts' too."""
    model = use_formats(random_model(tiny_args(moe=True), seed=4), Tuning(fast=False))
    assert type(model.layers["0"].attention.wq) is nn.Linear and type(model.layers["0"].attention) is Attention
    assert type(model.layers["0"].feed_forward) is MoeLayer
    quantize_model(model, "int4")
    use_formats(model, Tuning(fast=False))
    assert type(model.layers["0"].attention.wq) is ReferenceLinear
    moe = model.layers["0"].feed_forward
    assert type(moe) is ReferenceQuantizedMoeLayer
    x = torch.randn(3, model.args.dim, generator=torch.Generator().manual_seed(0))
    expected = F.linear(F.silu(F.linear(x, moe.w1[1].dequantize())) * F.linear(x, moe.w3[1].dequantize()), moe.w2[1].dequantize())
    torch.testing.assert_close(moe.expert(1, x), expected)
    fast = use_formats(model, Tuning())  # the same weights through the kernels
    assert type(fast.layers["0"].feed_forward) is FastMoeLayer
    torch.testing.assert_close(fast.layers["0"].feed_forward.expert(1, x), expected, atol=1e-4, rtol=1e-4)


def test_swapping_back_restores_the_reference_and_keeps_every_name():
    """Unpacking puts plain parameters back and the modules follow; the state dict's names and
    values are the reference's throughout."""
    model = random_model(tiny_args(moe=True), seed=5).to(PACKS)
    names = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pack_model(model, dtypes=(PACKS,))
    assert type(model.layers["0"].attention.wq) is PackedBf16Linear
    packed = model.state_dict()
    assert set(packed) == set(names) and all(torch.equal(packed[n], names[n]) for n in names)
    unpack_model(model)
    assert type(model.layers["0"].attention.wq) is PlainLinear and type(model.layers["0"].feed_forward) is FastMoeLayer
    assert isinstance(model.layers["0"].feed_forward.w1, nn.Parameter)
    use_formats(model, Tuning(fast=False))
    assert type(model.layers["0"].attention.wq) is nn.Linear and type(model.layers["0"].feed_forward) is MoeLayer
    assert type(model.layers["1"].feed_forward) is not FeedForward  # a Mixtral's blocks are MoE layers
