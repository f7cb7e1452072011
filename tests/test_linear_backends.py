"""The weight back-ends' table (``kernels.linear.BACKENDS``): which back-end reads each kind of
weight, as the package docstring's table says; and adding a back-end is its file and one line of
the table (here a class in this file, and the table patched with one more line)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import PACKS, random_model, tiny_args
from torch import nn

from mixtral_infer.fast.cpu_column_blocks import to_blocks
from mixtral_infer.fast.cpu_packed import pack
from mixtral_infer.formats.modules import prepare_and_swap, use_formats
from mixtral_infer.kernels import linear as backends
from mixtral_infer.kernels.linear import (
    ColumnBlocksLinear,
    GemliteLinear,
    Int4Linear,
    Int8Linear,
    LinearBackend,
    Nf4Linear,
    PackedBf16Linear,
    PlainLinear,
    ReferenceLinear,
    TritonDenseLinear,
    W8a8Linear,
    backend_for,
    put_weight,
    w8a8,
)
from mixtral_infer.quant.model import is_quantized
from mixtral_infer.quant.weights import QuantScheme, quantize
from mixtral_infer.tuning import Tuning

FAST, REFERENCE = Tuning(), Tuning(fast=False)


def quantized(scheme: str, shape=(64, 128)):
    return quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(0)), QuantScheme.parse(scheme), torch.bfloat16)


def test_each_kind_of_weight_is_read_by_the_back_end_the_table_names():
    plain = torch.randn(64, 128)
    assert backend_for(plain, FAST) is PlainLinear
    assert backend_for(to_blocks(plain, 32), FAST) is ColumnBlocksLinear
    assert backend_for(pack(plain.to(PACKS)), FAST) is PackedBf16Linear
    assert backend_for(quantized("int8"), FAST) is Int8Linear
    assert backend_for(quantized("int4"), FAST) is Int4Linear
    assert backend_for(quantized("nf4"), FAST) is Nf4Linear
    assert backend_for(quantized("int8", (4, 64, 128)), FAST) is Int8Linear  # stacked experts too
    held_by_fbgemm = quantized("w8a8")
    w8a8.pack_weights([held_by_fbgemm])
    assert backend_for(held_by_fbgemm, FAST) is (W8a8Linear if w8a8.available() else Int8Linear)
    assert backend_for(quantized("w8a8"), FAST) is Int8Linear  # not packed for fbgemm: int8's kernels
    packed_by_gemlite = quantized("int4")
    packed_by_gemlite.gemlite = object()  # what GemLite's back-end prepares at load on a GPU
    assert backend_for(packed_by_gemlite, FAST) is GemliteLinear
    # Tuning picks back-ends: Triton's ahead of GemLite for dense int8/int4, and the reference for all
    triton = Tuning(triton_dense=True)
    assert backend_for(quantized("int8"), triton) is TritonDenseLinear
    assert backend_for(packed_by_gemlite, triton) is TritonDenseLinear
    assert backend_for(quantized("nf4"), triton) is Nf4Linear  # not a kind its kernels read
    assert backend_for(quantized("int8", (4, 64, 128)), triton) is Int8Linear  # stacked experts neither
    for weight in (plain, quantized("int8"), quantized("nf4"), packed_by_gemlite):
        assert backend_for(weight, REFERENCE) is ReferenceLinear


def test_a_device_the_back_end_does_not_run_on_falls_to_the_next_line():
    """The packed and fbgemm back-ends are CPU-only: a weight that claims another device is not theirs."""

    class Elsewhere:
        device = torch.device("meta")

    assert not PackedBf16Linear.takes(Elsewhere(), FAST) and not W8a8Linear.takes(Elsewhere(), FAST)
    assert ReferenceLinear.takes(Elsewhere(), REFERENCE)


def test_swapping_in_gives_each_module_its_back_end_and_its_tuning_once():
    tuning = Tuning(streams=3)
    model = use_formats(random_model(tiny_args(moe=False), seed=1), tuning)
    wq = model.layers["0"].attention.wq
    assert type(wq) is PlainLinear and wq.tuning is tuning and model.layers["0"].attention.tuning is tuning
    x = torch.randn(2, wq.in_features)
    torch.testing.assert_close(wq(x), F.linear(x, wq.weight))
    use_formats(model, REFERENCE)
    assert type(wq) is nn.Linear  # a plain parameter under the reference: the model's own module


class TransposedWeight(nn.Module):
    """A new kind of weight: the matrix kept transposed, ``(IN, OUT)``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("transposed", weight.t().contiguous())
        self.shape = weight.shape

    @property
    def device(self) -> torch.device:
        return self.transposed.device


class TransposedLinear(LinearBackend):
    """The back-end a new file would hold: which weights, the layout at load, the product."""

    devices = ("cpu",)

    @classmethod
    def reads(cls, weight: object) -> bool:
        return isinstance(weight, TransposedWeight)

    @classmethod
    def prepare_model(cls, model: nn.Module, tuning: Tuning, pack: bool | str) -> None:
        for name, param in list(model.named_parameters()):
            if is_quantized(name) and param.dim() == 2:
                put_weight(model, name, TransposedWeight(param.data))

    @staticmethod
    def product(x: torch.Tensor, weight: TransposedWeight, tuning: Tuning = backends.DEFAULT) -> torch.Tensor:
        return x @ weight.transposed  # (M, IN) @ (IN, OUT)


@pytest.mark.parametrize("moe", [False, True], ids=["mistral", "mixtral"])
def test_a_new_back_end_is_its_file_and_one_line_of_the_table(monkeypatch, moe):
    """Loading's one call (``prepare_and_swap``) lays the weights out and swaps the new back-end in
    from the table alone; the model's logits are the plain model's."""
    monkeypatch.setattr(backends, "BACKENDS", (backends.BACKENDS[0], TransposedLinear, *backends.BACKENDS[1:]))  # the one line
    plain = random_model(tiny_args(moe=moe), seed=3)
    tokens = torch.tensor([1, 5, 9, 2, 7])
    expected = plain(tokens, [5])
    model = prepare_and_swap(random_model(tiny_args(moe=moe), seed=3), FAST, pack=False)
    assert type(model.layers["0"].attention.wq) is TransposedLinear
    assert isinstance(model.layers["0"].attention.wq.weight, TransposedWeight)
    torch.testing.assert_close(model(tokens, [5]), expected, atol=1e-5, rtol=1e-5)


def test_one_weight_of_a_joined_group_replaced_is_read_by_its_own_back_end():
    """wq made plain again in a packed model: wk and wv stay packed, each read by its own back-end."""
    from mixtral_infer.formats.modules import replace_parameter
    from mixtral_infer.formats.packing import pack_model

    plain = random_model(tiny_args(moe=False), seed=6).to(PACKS)
    tokens = torch.tensor([3, 1, 4, 1, 5])
    expected = plain(tokens, [5])
    model = pack_model(random_model(tiny_args(moe=False), seed=6).to(PACKS), dtypes=(PACKS,))
    wq = model.layers["0"].attention.wq
    replace_parameter(model, "layers.0.attention.wq.weight", nn.Parameter(wq.weight.dense(), requires_grad=False))
    assert type(model.layers["0"].attention.wq) is PlainLinear and type(model.layers["0"].attention.wk) is PackedBf16Linear
    tolerance = 1e-5 if PACKS == torch.float32 else 2e-2
    torch.testing.assert_close(model(tokens, [5]), expected, atol=tolerance, rtol=tolerance)


def test_blocks_of_columns_are_read_on_any_device_they_were_moved_to():
    assert backend_for(to_blocks(torch.randn(64, 128, device="meta"), 32), FAST) is ColumnBlocksLinear


@pytest.mark.skipif(not w8a8.available(), reason="fbgemm (x86 PyTorch builds) is not in this PyTorch")
def test_w8a8_weights_on_a_model_moved_off_the_cpu_take_int8s_path():
    """fbgemm's matrices stay on the CPU; rows from elsewhere (meta here, as a GPU's would) go to int8's
    back-end, which reads the integers back: the shape of the reference's product, no fbgemm call."""
    weight = quantized("w8a8")
    w8a8.pack_weights([weight])
    x = torch.randn(2, 128, device="meta", dtype=torch.bfloat16)
    assert W8a8Linear.product(x, weight).shape == (2, 64)
    assert [out.shape for out in W8a8Linear.products(x, [weight])] == [(2, 64)]


def test_only_the_back_ends_the_tuning_wants_lay_weights_out(monkeypatch):
    class Unwanted(PlainLinear):
        @classmethod
        def wanted(cls, tuning: Tuning) -> bool:
            return False

        @classmethod
        def prepare_model(cls, model, tuning, pack):
            raise AssertionError("laid out by a back-end the tuning does not want")

    monkeypatch.setattr(backends, "BACKENDS", (Unwanted, *backends.BACKENDS))
    backends.prepare_model(random_model(tiny_args(moe=False), seed=1), FAST)


def test_the_tuning_of_a_model_swapped_part_by_part_is_the_parts():
    from mixtral_infer.formats.modules import tuning_of

    tuning = Tuning(streams=5)
    model = random_model(tiny_args(moe=False), seed=1)
    del model.tuning
    use_formats(model.layers["0"], tuning)
    assert tuning_of(model) is tuning  # found on the first part swapped, not Tuning.default()
