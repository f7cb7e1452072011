"""Weight-only quantization: the formats' worked examples, the kernels against the dequantize
reference, and quantized models decoding alike on every path (eager, static, compiled)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import WINDOW, random_model, tiny_args
from test_model import random_prompts

from mixtral_infer.kernels.linear import int4, int8, quantized_common
from mixtral_infer import generate
from mixtral_infer.errors import ConfigError
from mixtral_infer.fast.cpu_reductions import REDUCTION_ROWS
from mixtral_infer.steps.decode_step import moe_one_token
from mixtral_infer.quant import nf4
from mixtral_infer.kernels.linear import prepare_weight, linear, reference_linear
from mixtral_infer.kernels.linear.quantized_common import uses_cpu_kernel
from mixtral_infer.quant.model import is_quantized, is_quantized_published
from mixtral_infer.formats.quantizing import quantize_model
from mixtral_infer.quant.weights import QuantizedParameter, QuantizedWeight, QuantScheme, quantize
from mixtral_infer.tuning import Tuning

INT8, INT4 = QuantScheme.parse("int8"), QuantScheme.parse("int4")
needs_nf4_kernel = pytest.mark.skipif(
    nf4.kernel() is None, reason="bitsandbytes' NF4 kernel needs an x86 CPU with AVX512-BF16"
)
SCHEMES = {"int8": INT8, "int4-32": INT4, "int4-128": QuantScheme.parse("int4-128")}


def example_scheme(name: str, group_size: int) -> QuantScheme:
    """A 4-bit scheme with a group size below what the kernels take (QuantScheme refuses it): for
    the docstrings' worked examples only."""
    scheme = object.__new__(QuantScheme)
    object.__setattr__(scheme, "name", name)
    object.__setattr__(scheme, "group_size", group_size)
    return scheme


def test_int4_worked_example():
    """The module docstring's example: G = 4, w = [0.7, -0.35, 0.1, 0.0]."""
    weight = quantize(torch.tensor([[0.7, -0.35, 0.1, 0.0]]), example_scheme("int4", 4))
    assert weight.scales.tolist() == [[0.10009765625]]
    assert weight.values.tolist() == [[95, 137]]
    assert weight.integers().tolist() == [[7, -3, 1, 0]]
    torch.testing.assert_close(weight.dequantize(), torch.tensor([[7, -3, 1, 0]]) * 0.10009765625)


def test_int8_scales_per_output_row():
    weight = quantize(torch.tensor([[1.27, -0.635, 0.0], [0.0, 0.0, 0.0]]), INT8)
    assert weight.scales.tolist() == [torch.tensor(0.01, dtype=torch.bfloat16).item(), 1.0]  # an all-zero row: scale 1
    assert weight.integers().tolist() == [[127, -63, 0], [0, 0, 0]]  # -0.635 / 0.010009765625 = -63.4


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantization_error_is_within_half_a_step(scheme):
    """Each value is rounded to the nearest multiple of its scale: |w - dequantized| <= scale / 2."""
    w = torch.randn(3, 32, 256, generator=torch.Generator().manual_seed(1))
    weight = quantize(w, SCHEMES[scheme])
    step = weight.scales if scheme == "int8" else weight.scales.repeat_interleave(SCHEMES[scheme].group_size, -1)
    step = step[..., None] if scheme == "int8" else step
    assert ((w - weight.dequantize()).abs() <= step / 2 + 1e-6).all()
    assert weight.shape == w.shape and weight[1].shape == w[1].shape
    torch.testing.assert_close(weight[1].dequantize(), weight.dequantize()[1])


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 33])
def test_kernel_equals_the_dequantize_reference(scheme, rows):
    """bfloat16 activations take PyTorch's kernel; it equals dequantize-then-matmul in float32 up to
    bfloat16 rounding of the result (a layout mistake would be off by the whole value)."""
    g = torch.Generator().manual_seed(rows)
    weight = prepare_weight(quantize(torch.randn(2, 96, 256, generator=g), SCHEMES[scheme], torch.bfloat16), keep_values=True)
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
    for expert in range(2):
        assert uses_cpu_kernel(x, weight[expert])
        got = linear(x, weight[expert]).float()
        expected = x.float() @ weight[expert].dequantize().T
        assert (got - expected).abs().max() <= 2**-7 * expected.abs().max()


@pytest.mark.parametrize("upcast", [False, True], ids=["16-bit", "float32"])
def test_int8_prefill_chunks_dequantize_then_multiply(upcast, monkeypatch):
    """From DEQUANTIZE_ROWS rows on, CPU int8 skips its kernel (slower there) for dequantize + F.linear:
    where 16-bit products are the faster (Tuning.upcast, fast.cpu_upcast), exactly the reference's product."""
    tuning = Tuning(upcast=frozenset({torch.bfloat16}) if upcast else frozenset())
    weight = prepare_weight(quantize(torch.randn(64, 128), SCHEMES["int8"], torch.bfloat16))
    calls = []
    kernel = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    for rows in (quantized_common.DEQUANTIZE_ROWS - 1, quantized_common.DEQUANTIZE_ROWS):
        x = torch.randn(rows, 128).to(torch.bfloat16)
        got, expected = linear(x, weight, tuning), reference_linear(x, weight)
        assert (got.float() - expected.float()).abs().max() <= 2**-7 * expected.float().abs().max()
    assert calls == [quantized_common.DEQUANTIZE_ROWS - 1]
    assert upcast or torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fast_int8_dequantizing_is_the_reference_bit_for_bit(dtype):
    """One conversion and a multiply in place give ``dequantize``'s numbers (two float32 copies), also
    for stacked experts and where a bfloat16 scale is not a float16 number."""
    w = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(4)) * torch.logspace(-6, 2, 3)[:, None, None]
    weight = quantize(w, SCHEMES["int8"], torch.bfloat16)  # (E, OUT, IN)
    assert torch.equal(int8.dequantize_int8(weight, dtype), weight.dequantize(dtype))
    assert torch.equal(int8.dequantize_int8(weight[1], dtype), weight.dequantize(dtype)[1])


@pytest.mark.parametrize("rows", [64, 128, 192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_int4_kernel_layout_reads_back_as_the_weight(rows, dtype):
    """Where this CPU's int4 layout is the documented one (the probe, ``int4_cpu_layout_reads_back``),
    it reads back as the weight; where it is not (AVX2 builds lay blocks out otherwise), the probe says
    so and a prompt's product keeps the kernel, equal to the reference."""
    weight = prepare_weight(quantize(torch.randn(rows, 96), INT4, torch.bfloat16), keep_values=True)
    nibbles = torch.stack([weight.values & 15, weight.values >> 4], dim=-1).flatten(-2)  # (OUT, IN)
    documented = torch.equal(weight.packed[0].view(torch.uint8), int4.documented_int4_layout(nibbles))
    assert int4.int4_cpu_layout_reads_back() == documented
    if documented:
        assert torch.equal(int4.dequantize_int4_kernel_layout(weight, dtype), weight.dequantize(dtype))
    else:
        x = torch.randn(quantized_common.DEQUANTIZE_ROWS, 96, dtype=torch.bfloat16)
        got = linear(x, weight, Tuning()).float()
        torch.testing.assert_close(got, F.linear(x.float(), weight.dequantize(torch.float32)), atol=0.05, rtol=0.02)


def test_int4_prefill_reads_its_layout_back_where_float32_is_faster(monkeypatch):
    """With Tuning.upcast choosing float32 and at least INT4_DEQUANTIZE_ROWS rows, int4 skips its
    kernel; a weight whose rows are not whole 64-row blocks (80) keeps it."""
    tuning = Tuning(upcast=frozenset({torch.bfloat16}))
    calls = []
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", lambda *a: calls.append(a[1].shape[0]) or kernel(*a))
    x = torch.randn(int4.INT4_DEQUANTIZE_ROWS, 64).to(torch.bfloat16)
    for out_features in (128, 80):
        weight = prepare_weight(quantize(torch.randn(out_features, 64), INT4, torch.bfloat16), keep_values=True)
        got, expected = linear(x, weight, tuning).float(), reference_linear(x, weight).float()
        assert (got - expected).abs().max() <= 2**-7 * expected.abs().max()
        linear(x[:4], weight, tuning)  # decoding-sized: the kernel
    # where the probe finds another layout (AVX2), prompts keep the kernel too
    assert calls == ([128, 80, 80] if int4.int4_cpu_layout_reads_back() else [128, 128, 80, 80])


def test_int4_prefill_reads_its_layout_back_into_16_bits_where_those_are_faster(monkeypatch):
    """Where Tuning.upcast keeps 16-bit products (they are the faster), int4 skips its kernel from
    DEQUANTIZE_ROWS rows on and equals the reference (which dequantizes to x's dtype too); a weight
    whose rows are not whole 64-row blocks (80) keeps the kernel."""
    tuning = Tuning(upcast=frozenset())
    calls = []
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
    counted = lambda *a: calls.append(a[1].shape[0]) or kernel(*a)  # noqa: E731
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", counted)
    x = torch.randn(quantized_common.DEQUANTIZE_ROWS, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    for out_features in (128, 80):
        weight = prepare_weight(quantize(torch.randn(out_features, 64), INT4, torch.bfloat16), keep_values=True)
        got, expected = linear(x, weight, tuning), reference_linear(x, weight)
        if out_features == 128 and int4.int4_cpu_layout_reads_back():
            assert torch.equal(got, expected)  # the same bfloat16 weight, the same product
        else:  # the kernel: its own rounding
            assert (got.float() - expected.float()).abs().max() <= 2**-7 * expected.float().abs().max()
        linear(x[:-1], weight, tuning)  # one row fewer: the kernel
    assert calls == ([128, 80, 80] if int4.int4_cpu_layout_reads_back() else [128, 128, 80, 80])


def test_tinygemm_bytes_worked_example():
    """The plain layout's input 2j moves to the high nibble (int4.tinygemm_bytes' docstring)."""
    plain = torch.tensor([[95, 137]], dtype=torch.uint8)  # inputs [15, 5, 9, 8] (test_int4_worked_example)
    assert int4.tinygemm_bytes(plain).tolist() == [[245, 152]]  # 15 << 4 | 5, 9 << 4 | 8


def test_cuda_inner_k_tiles():
    assert [int4.cuda_inner_k_tiles(n) for n in (4096, 14336, 256, 64, 96, 40)] == [2, 2, 2, 2, 2, None]


def test_tinygemm_layout_hands_cuda_the_weight_with_input_2j_high():
    """What ``prepare`` gives CUDA's ``_convert_weight_to_int4pack`` (not on this machine): each expert's
    (OUT, IN/2) bytes, read as tinygemm reads them (input 2j in the high nibble, ``(n - 8) * scale
    + zero`` with the scales of ``scales_and_zeros``), are the weight itself."""
    weight = quantize(torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(3)), INT4, torch.bfloat16)
    handed = []

    def convert(matrix, tiles):  # stands in for the CUDA op: records what it gets, returns its shape
        handed.append((matrix.clone(), tiles))
        return torch.zeros(matrix.shape[0] // 8, matrix.shape[1] * 2 // (16 * tiles), 32, tiles // 2, dtype=torch.int32)

    packed, scales_and_zeros = int4.tinygemm_layout(weight, convert)
    assert packed.shape == (2, 8, 8, 32, 1) and packed.dtype == torch.int32  # (OUT/8, IN/(16 tiles), 32, tiles/2)
    assert scales_and_zeros.shape == (2, 256 // 32, 64, 2) and scales_and_zeros.dtype == torch.bfloat16
    for expert, (matrix, tiles) in enumerate(handed):
        assert tiles == 2 and matrix.dtype == torch.uint8 and matrix.is_contiguous()
        n = torch.stack([matrix >> 4, matrix & 15], dim=-1).flatten(-2).float()  # (OUT, IN): 2j high, 2j + 1 low
        scale, zero = scales_and_zeros[expert].float().transpose(0, 1).repeat_interleave(32, dim=1).unbind(-1)  # (OUT, IN)
        torch.testing.assert_close((n - 8) * scale + zero, weight[expert].dequantize(), rtol=0, atol=0)
    assert int4.int4_layout(QuantizedWeight(INT4, weight.values, weight.scales, 256, (packed, scales_and_zeros))) == "cuda"


def test_a_layout_made_for_the_other_device_is_not_read():
    """A model moved between devices keeps its kernel layout: CPU bfloat16 activations on a weight
    holding tinygemm's int32 tiles (and its plain values) take the reference path, not the CPU kernel."""
    weight = quantize(torch.randn(64, 128), INT4, torch.bfloat16)
    tiles = torch.zeros(8, 1, 32, 4, dtype=torch.int32)  # tinygemm's shape for (64, 128); never read
    moved = QuantizedWeight(INT4, weight.values, weight.scales, 128, (tiles, int4._scales_and_zeros(weight)))
    assert int4.int4_layout(moved) == "cuda" and int4.int4_layout(prepare_weight(weight, keep_values=True)) == "cpu"
    x = torch.randn(3, 128).to(torch.bfloat16)
    torch.testing.assert_close(linear(x, moved), reference_linear(x, weight))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="tinygemm (_weight_int4pack_mm) runs on CUDA only; no GPU here")
def test_cuda_int4_kernel_equals_the_dequantize_reference():
    """On CUDA, int4 bfloat16 weights get tinygemm's layout; few rows take its kernel, many dequantize."""
    g = torch.Generator().manual_seed(5)
    weight = prepare_weight(quantize(torch.randn(2, 96, 256, generator=g).cuda(), INT4, torch.bfloat16))
    assert int4.int4_layout(weight) == "cuda" and weight.values is not None
    for rows in (1, 8, int4.CUDA_INT4_DEQUANTIZE_ROWS + 1):
        x = torch.randn(rows, 256, generator=g).to("cuda", torch.bfloat16)
        for expert in (1, torch.tensor(1, device="cuda")):  # views, and compiled code's gathered copy
            got = linear(x, weight[expert]).float()
            expected = x.float() @ weight[1].dequantize().T
            assert (got - expected).abs().max() <= 2**-7 * expected.abs().max()


def test_float32_activations_take_the_reference_path():
    weight = prepare_weight(quantize(torch.randn(32, 64), INT4, torch.float32))
    x = torch.randn(3, 64)
    assert weight.packed is None and not uses_cpu_kernel(x, weight)
    torch.testing.assert_close(linear(x, weight), x @ weight.dequantize().T)
    torch.testing.assert_close(reference_linear(x, weight), x @ weight.dequantize().T)


def test_scheme_names_and_errors():
    assert QuantScheme.parse("int4-128") == QuantScheme("int4", 128)
    assert QuantScheme.parse({"scheme": "int8"}) == INT8
    assert QuantScheme.parse("int4").to_params() == {"scheme": "int4", "group_size": 32}
    with pytest.raises(ConfigError, match="quantize=.int3.: expected one of int8, w8a8, int4"):
        QuantScheme.parse("int3")
    with pytest.raises(ConfigError, match=r"int4 group_size=48: expected one of \(32, 64, 128, 256\)"):
        QuantScheme.parse("int4-48")
    with pytest.raises(ConfigError, match="only int4 and nf4 take a group size"):
        QuantScheme.parse("int8-32")
    with pytest.raises(ConfigError, match="only int4 and nf4 take a group size"):
        QuantScheme.parse("int8-")
    for typed in ("int4-", "nf4-\u00b2", "int4-\u0663", "int4-1 28"):  # nothing after the dash, "²", Arabic-Indic "3"
        message = f"quantize={typed!r}: the group size after '{typed.partition('-')[0]}-' must be a number"
        with pytest.raises(ConfigError, match=re.escape(message)):
            QuantScheme.parse(typed)
    with pytest.raises(ConfigError, match="96 inputs are not a multiple of the int4 group size 64"):
        quantize(torch.randn(16, 96), QuantScheme("int4", 64))


def test_which_weights_are_quantized():
    model = quantize_model(random_model(tiny_args(moe=True)), "int8")
    quantized = sorted(name for name, module in model.named_modules() if isinstance(module, QuantizedParameter))
    assert quantized == [
        f"layers.{i}.{part}" for i in range(2)
        for part in ["attention.wk.weight", "attention.wo.weight", "attention.wq.weight", "attention.wv.weight",
                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    ] + ["output.weight"]  # fmt: skip
    kept = sorted(name for name, _ in model.named_parameters())
    assert kept == ["layers.0.attention_norm.weight", "layers.0.feed_forward.gate.weight", "layers.0.ffn_norm.weight",
                    "layers.1.attention_norm.weight", "layers.1.feed_forward.gate.weight", "layers.1.ffn_norm.weight",
                    "norm.weight", "tok_embeddings.weight"]  # fmt: skip
    assert is_quantized("layers.3.feed_forward.w2.weight") and not is_quantized("layers.3.feed_forward.gate.weight")
    assert is_quantized_published("layers.3.feed_forward.experts.7.w2.weight")
    assert not is_quantized_published("tok_embeddings.weight") and not is_quantized_published("norm.weight")


def test_quantizing_in_memory_frees_each_float_weight_as_it_goes(monkeypatch):
    """When weight k is quantized, weights 0..k-1 are gone: the float model and its quantized
    copy are never both whole in memory (Mixtral 8x7B on one GPU: 93 + 47 GB)."""
    import weakref

    from mixtral_infer.formats import quantizing

    model = random_model(tiny_args(moe=True), seed=3)
    floats = {name: weakref.ref(param) for name, param in model.named_parameters() if is_quantized(name)}
    alive_at_each_call = []
    quantize_tensor = quantizing.quantize_tensor

    def counting(tensor, *args, **options):
        alive_at_each_call.append(sum(ref() is not None for ref in floats.values()))
        return quantize_tensor(tensor, *args, **options)

    monkeypatch.setattr(quantizing, "quantize_tensor", counting)
    quantize_model(model, "int8")
    assert alive_at_each_call == list(range(len(floats), 0, -1))  # the one being quantized and those after it


@pytest.mark.parametrize("scheme", ["int8", "int4", "nf4-32"])
def test_quantized_model_equals_the_float_model_of_its_dequantized_weights(scheme):
    """The grouped MoE path and every linear() call site read the quantized weights: a float model
    holding the dequantized weights gives the same logits (float32, the reference path)."""
    model = random_model(tiny_args(moe=True), seed=3)
    quantized = quantize_model(random_model(tiny_args(moe=True), seed=3), scheme)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, QuantizedParameter):
                model.get_parameter(name).copy_(module.dequantize())
        ids = torch.tensor(random_prompts([12], 128, seed=4)[0])
        torch.testing.assert_close(quantized(ids, seqlens=[12]), model(ids, seqlens=[12]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("moe", [False, True], ids=["mistral", "mixtral"])
def test_quantized_static_decode_equals_eager(moe, scheme, dtype):
    """Batch 1 (the MoE gathers its 2 experts) and batch 3 (every expert runs), past the window.
    float32 runs the reference path: logprobs to 1e-5. bfloat16 runs the kernels: the same
    tokens, logprobs as close as bfloat16 decoding is without quantization."""
    model = quantize_model(random_model(tiny_args(moe=moe), seed=5).to(dtype), scheme)
    for lengths in ([5], [2 * WINDOW + 1, 3, 6]):
        prompts = random_prompts(lengths, 128, seed=len(lengths))
        eager_tokens, eager_logprobs = generate(prompts, model, max_tokens=2 * WINDOW, decode="eager")
        static_tokens, static_logprobs = generate(prompts, model, max_tokens=2 * WINDOW, decode="static")
        assert static_tokens == eager_tokens
        tolerance = 1e-5 if dtype == torch.float32 else 0.1
        for got, expected in zip(static_logprobs, eager_logprobs):
            assert got == pytest.approx(expected, abs=tolerance)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_quantized_moe_one_token_equals_the_grouped_layer(batch):
    layer = quantize_model(random_model(tiny_args(moe=True), seed=25), "int4").layers["0"].feed_forward
    x = torch.randn(batch, 64, generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        torch.testing.assert_close(moe_one_token(layer, x), layer(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "scheme", ["int8", "int4", "plain-large", "plain-large-float16", "plain-large-bfloat16", "plain-small"]
)
def test_chosen_experts_go_one_by_one_up_to_twice_or_once_as_many_assignments_as_experts(scheme, monkeypatch):
    """4 experts, top-2: batch 1 (2 assignments) reads its chosen experts; quantized experts are read
    one by one up to batch 4 (8 = 2E assignments, ``Tuning.chosen_up_to_quantized``; at batch 2 the
    same 4 expert matrices as every expert would read, one row each), large plain float32 and
    float16 ones too (``Tuning.chosen_up_to_plain``; ``one_by_one_min_weights`` lowered to the tiny
    model's experts), large bfloat16 ones up to batch 2 (4 = E, ``Tuning.chosen_up_to_bfloat16``),
    small plain ones are gathered at batch 1 only. With the field at 0, every expert from batch 2
    on. Each form equals the grouped layer."""
    from mixtral_infer.kernels.moe import strategy

    model = random_model(tiny_args(moe=True), seed=25)
    quantized = scheme.startswith("int")
    dtypes = {"plain-large-float16": torch.float16, "plain-large-bfloat16": torch.bfloat16,
              "plain-small": torch.bfloat16}  # fmt: skip
    model = model.to(dtypes.get(scheme, torch.float32))
    layer = (quantize_model(model, scheme) if quantized else model).layers["0"].feed_forward
    tuning = Tuning(one_by_one_min_weights=0) if scheme.startswith("plain-large") else Tuning()
    forms, letters = [], {"experts_one_by_one": "c", "gathered_experts": "g", "every_expert_one_by_one": "v",
                          "every_expert_batched": "v"}  # fmt: skip
    for name, letter in letters.items():
        form = getattr(strategy, name)
        monkeypatch.setattr(strategy, name, lambda *a, form=form, letter=letter: forms.append(letter) or form(*a))
    field = strategy.chosen_up_to_field(layer, tuning)
    assert field == {"plain-large-bfloat16": "chosen_up_to_bfloat16", "plain-small": None}.get(
        scheme, "chosen_up_to_quantized" if quantized else "chosen_up_to_plain"
    )
    assert (Tuning().chosen_up_to_quantized, Tuning().chosen_up_to_plain, Tuning().chosen_up_to_bfloat16) == (2, 2, 1)
    close = dict(atol=1e-5, rtol=1e-5) if model.dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for up_to in (getattr(tuning, field) if field else 0, 0):
        if field is not None:
            tuning = dataclasses.replace(tuning, **{field: up_to})
        for batch in (1, 2, 3, 4):
            x = torch.randn(batch, 64, generator=torch.Generator().manual_seed(batch)).to(model.dtype)
            with torch.no_grad():
                torch.testing.assert_close(moe_one_token(layer, x, tuning), layer(x), **close)
    # c: the chosen experts one by one, g: gathered (small plain experts), v: every expert
    expected = {"int8": "cccc" + "cvvv", "int4": "cccc" + "cvvv", "plain-large": "cccc" + "cvvv",
                "plain-large-float16": "cccc" + "cvvv", "plain-large-bfloat16": "ccvv" + "cvvv",
                "plain-small": "gvvv" + "gvvv"}[scheme]  # fmt: skip
    assert "".join(forms) == expected


def test_quantized_step_compiles_and_equals_eager():
    """int4 kernels inside torch.compile(fullgraph=True), batch 1 (gathered experts), bfloat16."""
    model = quantize_model(random_model(tiny_args(moe=True, max_batch_size=1), seed=7).to(torch.bfloat16), "int4")
    prompts = random_prompts([WINDOW + 3], 128, seed=8)
    eager_tokens, eager_logprobs = generate(prompts, model, max_tokens=2 * WINDOW, decode="eager")
    compiled_tokens, compiled_logprobs = generate(prompts, model, max_tokens=2 * WINDOW, decode="compiled")
    assert compiled_tokens == eager_tokens
    assert compiled_logprobs[0] == pytest.approx(eager_logprobs[0], abs=0.1)


@pytest.mark.parametrize("scheme", ["int8", "int4", "nf4-32"])
def test_an_expert_picked_by_a_tensor_is_read_in_place_on_cpu(scheme):
    """``w[tensor(e)]`` keeps the stacked tensors and the index (no copy of the expert's weights);
    the kernel's op multiplies by expert e's views: the same numbers as ``w[e]``, exactly."""
    stacked = prepare_weight(quantize(torch.randn(4, 64, 96), QuantScheme.parse(scheme), torch.bfloat16))  # (E, OUT, IN)
    x = torch.randn(2, 96).bfloat16()
    for e in range(4):
        lazy = stacked[torch.tensor(e)]
        assert lazy.expert is not None and lazy.scales is stacked.scales and lazy.shape == (64, 96)
        assert torch.equal(linear(x, lazy), linear(x, stacked[e]))
        assert torch.equal(lazy.resolved().scales, stacked[e].scales)
    with pytest.raises(IndexError, match="already one expert"):
        stacked[torch.tensor(1)][0]


@pytest.mark.parametrize(
    "scheme, op, calls",
    [
        ("int4", "mixtral_infer::int4_expert_mm", 3),
        pytest.param("nf4-32", "mixtral_infer::nf4_expert_mm", 2, marks=needs_nf4_kernel),
        ("w8a8", "mixtral_infer::packed_linear", 2),
    ],
)
def test_the_compiled_moe_step_multiplies_experts_in_place(scheme, op, calls):
    """Compiled, batch 1 (2 of 4 experts): each expert matrix goes through the expert op (w8a8: fbgemm
    through the packed weights' op, nf4: bitsandbytes' kernel; both with w1 w3 side by side), which
    reads the routing's index (no gathered copy), and the layer equals its eager self."""
    layer = quantize_model(random_model(tiny_args(moe=True), seed=25).to(torch.bfloat16), scheme).layers["0"].feed_forward
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    compiled = torch.compile(moe_one_token, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        compiled(layer, x)  # compiles
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            out = compiled(layer, x)
        torch.testing.assert_close(out, moe_one_token(layer, x), atol=0.02, rtol=0.02)
    made = [e for e in profile.events() if e.name == op and (e.cpu_parent is None or e.cpu_parent.name != op)]
    assert len(made) == 2 * calls  # w1, w3 (w8a8, nf4: together), w2 of each chosen expert


@pytest.mark.parametrize("rows", [1, 2, 8, 9])
def test_compiled_int8_products_of_few_rows_are_reductions(rows):
    """Compiled, 1-8 rows of an int8 weight-only product are multiply-and-sums (fast.cpu_reductions):
    the exact integer products summed in float32, scaled, rounded once; 9 rows keep the kernel."""
    from torch._inductor.utils import run_and_get_code

    g = torch.Generator().manual_seed(rows)
    weight = prepare_weight(quantize(torch.randn(64, 128, generator=g), INT8, torch.bfloat16))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    torch._dynamo.reset()
    got, codes = run_and_get_code(torch.compile(linear, fullgraph=True, dynamic=False), x, weight)
    expected = (F.linear(x.float(), weight.values.float()) * weight.scales.float()).bfloat16()
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=2**-7)
    assert ("_weight_int8pack_mm" in "\n".join(codes)) == (rows > REDUCTION_ROWS[torch.int8])


def test_the_compiled_int8_moe_step_reads_the_chosen_experts_in_place():
    """Compiled, batch 1 (2 of 4 experts), int8 weight-only: multiply-and-sum reductions
    (fast.cpu_reductions) that index the stacked integers by the routing's choice: the generated code
    allocates nothing of an expert matrix's size (no gathered copy) and calls no int8 kernel, and the
    layer equals its eager self."""
    from torch._inductor.utils import run_and_get_code

    layer = quantize_model(random_model(tiny_args(moe=True), seed=25).to(torch.bfloat16), INT8).layers["0"].feed_forward
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    torch._dynamo.reset()
    with torch.inference_mode():
        out, codes = run_and_get_code(torch.compile(moe_one_token, fullgraph=True, dynamic=False), layer, x)
        torch.testing.assert_close(out, moe_one_token(layer, x), atol=0.02, rtol=0.02)
    hidden, dim = layer.w1.shape[-2:]  # (E, I, D)
    code = "\n".join(codes)
    assert "empty_strided_cpu((" in code  # the buffers it does allocate are in view
    for shape in (f"(({hidden}, {dim})", f"(({dim}, {hidden})", f"((1, {hidden}, {dim})"):
        assert shape not in code
    assert "_weight_int8pack_mm" not in code and "int8_expert_mm" not in code


def test_a_quantized_weight_is_no_parameter_and_moves_with_the_model():
    model = quantize_model(random_model(tiny_args(moe=False)).to(torch.bfloat16), "int4")
    weight = model.layers["0"].attention.wq.weight
    assert isinstance(weight, QuantizedWeight) and weight.packed is not None and weight.values is None
    assert {name for name in model.state_dict() if "wq" in name} == {"layers.0.attention.wq.weight.scales", "layers.1.attention.wq.weight.scales"}
