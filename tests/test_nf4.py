"""NF4 (quant/nf4.py): the code, its worked example, bitsandbytes' layout, and its kernel against
the dequantize reference, alone, per expert, compiled and in a decoding model."""

from __future__ import annotations

import copy
import ctypes
import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import WINDOW, random_model, tiny_args
from test_model import random_prompts
from test_quant import example_scheme

from mixtral_infer.kernels.linear import nf4 as nf4_linear
from mixtral_infer import generate
from mixtral_infer.kernels.linear import linear, linears
from mixtral_infer.quant import nf4
from mixtral_infer.kernels.linear.nf4 import joined_linear
from mixtral_infer.kernels.linear import prepare_weight, reference_linear
from mixtral_infer.formats.quantizing import install, quantize_model
from mixtral_infer.kernels.linear.nf4 import join_side_by_side
from mixtral_infer.quant.weights import QuantizedParameter, QuantizedWeight, QuantScheme, quantize
from mixtral_infer.serve.sizing import held_bytes, weight_bytes

NF4_32 = QuantScheme.parse("nf4-32")  # the tiny models' 96 inputs take groups of 32
needs_kernel = pytest.mark.skipif(
    nf4.kernel() is None, reason="bitsandbytes' NF4 kernel needs an x86 CPU with AVX512-BF16"
)


def test_the_default_group_is_64_and_the_scheme_is_recorded():
    assert QuantScheme.parse("nf4") == QuantScheme("nf4", 64)
    assert QuantScheme.parse({"scheme": "nf4", "group_size": 128}).to_params() == {"scheme": "nf4", "group_size": 128}
    assert QuantScheme.parse("nf4-32").label == "nf4 (groups of 32)"


def test_nf4_worked_example():
    """The module docstring's example: G = 4, w = [0.5, -0.25, 0.1, 0.0]."""
    weight = quantize(torch.tensor([[0.5, -0.25, 0.1, 0.0]]), example_scheme("nf4", 4))
    assert weight.scales.tolist() == [[0.5]]
    assert weight.integers().tolist() == [[15, 2, 9, 7]]
    assert weight.values.tolist() == [[47, 121]]
    expected = [0.5, 0.5 * -0.5250730514526367, 0.5 * 0.16093020141124725, 0.0]
    torch.testing.assert_close(weight.dequantize(), torch.tensor([expected]))


def test_each_value_takes_the_nearest_code():
    v = torch.rand(10_000, generator=torch.Generator().manual_seed(0)) * 2 - 1
    brute = (v[:, None] - nf4.code_values()[None, :]).abs().argmin(dim=1)  # (N,)
    assert torch.equal(nf4.nearest_codes(v).long(), brute)
    assert nf4.code_values()[7] == 0 and nf4.nearest_codes(torch.tensor([0.0, 1.0, -1.0])).tolist() == [7, 15, 0]


def test_nearest_codes_by_bins_equal_counting_midpoints_at_every_edge():
    """The bin lookup = the count of midpoints below each value, where a rounding could go wrong:
    every midpoint and bin edge and their float32 neighbours; the docstring's example (0.1205 ->
    9, bin 2294 holds the midpoint 0.12026), NaN to an end of the table rather than out of it."""
    mids = nf4.midpoints()
    edges = torch.arange(nf4.BINS + 1, dtype=torch.float32) * (2 / nf4.BINS) - 1
    points = torch.cat([mids, edges, torch.tensor([0.1205, 1.004, -1.004])])
    v = torch.cat([points, torch.nextafter(points, points + 1), torch.nextafter(points, points - 1)])
    assert torch.equal(nf4.nearest_codes(v).long(), (v[:, None] > mids[None, :]).sum(dim=1))
    below, next_midpoint = nf4._bin_tables()
    assert (below[2294], next_midpoint[2294]) == (8, mids[8]) and nf4.nearest_codes(torch.tensor(0.1205)) == 9
    assert nf4.nearest_codes(torch.tensor([float("nan")])).item() in (0, 15)
    # On the values' device (a GPU's weights are quantized on the GPU; "meta" stands in for it here,
    # where tables left on the CPU fail as they did on the H200).
    assert nf4.nearest_codes(torch.empty(5, device="meta")).device.type == "meta"


def test_the_kernel_layout_worked_example_and_its_inverse():
    """The ``kernel_layout`` docstring's example (OUT = 32, IN = 2), and the round trip over stacked experts."""
    codes = torch.arange(64, dtype=torch.uint8).view(32, 2) % 16  # n[row][input]
    plain = codes[:, 0] | (codes[:, 1] << 4)  # (32,): one byte a row
    packed = nf4.kernel_layout(plain.view(32, 1))
    assert packed.view(-1)[:2].tolist() == [int(codes[0, 0] | codes[16, 0] << 4), int(codes[0, 1] | codes[16, 1] << 4)]
    values = torch.randint(0, 256, (3, 96, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(nf4.plain_layout(nf4.kernel_layout(values)), values)


def test_each_weight_is_its_group_s_scale_times_the_nearest_code():
    """Quantizing then dequantizing moves each weight, in units of its group's scale, to the nearest
    NF4 value (brute force over the 16), and the scale is the group's largest magnitude."""
    w = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(2))
    weight = quantize(w, NF4_32)
    torch.testing.assert_close(weight.scales, w.unflatten(-1, (4, 32)).abs().amax(-1).bfloat16().float())
    v = w / weight.scales.repeat_interleave(32, -1)  # (2, 32, 128)
    nearest = (v[..., None] - nf4.code_values()).abs().min(dim=-1).values
    moved = (v - weight.dequantize() / weight.scales.repeat_interleave(32, -1)).abs()
    torch.testing.assert_close(moved, nearest, atol=1e-6, rtol=0)
    torch.testing.assert_close(weight[1].dequantize(), weight.dequantize()[1])


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_kernel_equals_the_dequantize_reference(rows, group):
    """bitsandbytes' kernel on its layout equals dequantize-then-matmul in float32 up to bfloat16
    rounding of the result (a layout mistake would be off by the whole value), per expert too, and
    an expert picked by a tensor (compiled code's routing) reads the stacked bytes in place."""
    g = torch.Generator().manual_seed(rows)
    weight = quantize(torch.randn(2, 96, 256, generator=g), QuantScheme("nf4", group), torch.bfloat16)
    reference = weight.dequantize()  # (2, 96, 256)
    prepare_weight(weight)
    assert weight.values is None and weight.packed[0].shape == (2, 96, 128)
    assert torch.equal(weight.dequantize(), reference)  # read back from the kernel's layout
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
    for expert in range(2):
        got = linear(x, weight[expert]).float()
        expected = x.float() @ reference[expert].T
        assert (got - expected).abs().max() <= 2**-7 * expected.abs().max()
        assert torch.equal(linear(x, weight[torch.tensor(expert)]), linear(x, weight[expert]))


@needs_kernel
def test_prompts_dequantize_to_the_reference_s_numbers_and_other_dtypes_take_the_reference(monkeypatch):
    """From ``NF4_DEQUANTIZE_ROWS`` rows on the weight is dequantized from the kernel's layout
    (``dequantize_nf4_kernel_layout``: ``dequantize``'s numbers bit for bit, here in three blocks of
    conversion), then ``F.linear``: the reference path's product exactly; float32 takes the reference."""
    weight = prepare_weight(quantize(torch.randn(640, 128), NF4_32, torch.bfloat16))
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(nf4_linear.dequantize_nf4_kernel_layout(weight, dtype), weight.dequantize(dtype))
    calls = []
    monkeypatch.setattr(nf4, "_nf4_mm", lambda *a: calls.append(1))  # the op's function, were it called
    for x in (torch.randn(nf4_linear.NF4_DEQUANTIZE_ROWS, 128).bfloat16(), torch.randn(3, 128)):
        assert torch.equal(linear(x, weight), reference_linear(x, weight))
    assert calls == []


def test_without_the_kernel_nf4_keeps_its_plain_layout_and_the_reference_path(monkeypatch):
    monkeypatch.setattr(nf4, "kernel", lambda: None)
    weight = prepare_weight(quantize(torch.randn(64, 128), NF4_32, torch.bfloat16))
    assert weight.packed is None and weight.values is not None
    x = torch.randn(2, 128).bfloat16()
    torch.testing.assert_close(linear(x, weight), torch.nn.functional.linear(x, weight.dequantize(torch.bfloat16)))


@needs_kernel
@pytest.mark.parametrize("moe", [False, True], ids=["mistral", "mixtral"])
def test_an_nf4_model_decodes_alike_eager_and_static(moe):
    """bfloat16 through the kernel: batch 1 (the MoE's chosen experts by the expert op) and a ragged
    batch of 3 past the window (every expert), the same tokens, logprobs as close as bfloat16 is."""
    model = quantize_model(random_model(tiny_args(moe=moe), seed=5).to(torch.bfloat16), NF4_32)
    assert model.layers["0"].attention.wq.weight.packed is not None
    for lengths in ([5], [2 * WINDOW + 1, 3, 6]):
        prompts = random_prompts(lengths, 128, seed=len(lengths))
        eager_tokens, eager_logprobs = generate(prompts, model, max_tokens=2 * WINDOW, decode="eager")
        static_tokens, static_logprobs = generate(prompts, model, max_tokens=2 * WINDOW, decode="static")
        assert static_tokens == eager_tokens
        for got, expected in zip(static_logprobs, eager_logprobs):
            assert got == pytest.approx(expected, abs=0.1)


@needs_kernel
def test_the_compiled_nf4_step_equals_eager():
    """The ops inside the compiled step (built ahead of time on CPU), batch 1, past the window. Greedy
    tokens of a random bfloat16 model can flip at near-ties between differently fused steps; this
    seed has none (as test_quant's int4 step)."""
    model = quantize_model(random_model(tiny_args(moe=True, max_batch_size=1), seed=7).to(torch.bfloat16), NF4_32)
    prompts = random_prompts([WINDOW + 3], 128, seed=8)
    eager_tokens, eager_logprobs = generate(prompts, model, max_tokens=2 * WINDOW, decode="eager")
    compiled_tokens, compiled_logprobs = generate(prompts, model, max_tokens=2 * WINDOW, decode="compiled")
    assert compiled_tokens == eager_tokens
    assert compiled_logprobs[0] == pytest.approx(eager_logprobs[0], abs=0.1)


def bitsandbytes_cpu_reader():
    """bitsandbytes' CPU reader of its own 4-bit format, ``cdequantize_blockwise_cpu_nf4_bf16(bytes,
    float32 scales, out, G, rows, inputs)``, or None: the format its CUDA kernel reads."""
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        library = ctypes.CDLL(str(Path(next(iter(spec.submodule_search_locations))) / "libbitsandbytes_cpu.so"))
        function = library.cdequantize_blockwise_cpu_nf4_bf16
    except (OSError, AttributeError):
        return None
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_longlong] * 3
    return function


def test_the_cuda_layout_worked_example_is_its_own_inverse():
    """``nf4.cuda_layout``'s docstring: byte 47 (inputs [15, 2]) becomes 242; twice gives the bytes back."""
    values = torch.randint(0, 256, (3, 64, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert nf4.cuda_layout(torch.tensor([47], dtype=torch.uint8)).tolist() == [242]
    assert torch.equal(nf4.cuda_layout(nf4.cuda_layout(values)), values)


@pytest.mark.skipif(bitsandbytes_cpu_reader() is None, reason="bitsandbytes' CPU library is not installed")
@pytest.mark.parametrize("group", [32, 64, 256])
def test_the_cuda_layout_is_bitsandbytes_format_read_back_by_its_own_reader(group):
    """What the CUDA kernel is handed (``with_cuda_nf4_layout``: the bytes, float32 scales), read by
    bitsandbytes' CPU reader of that same format, is ``dequantize``'s bfloat16 weight bit for bit,
    for each expert of stacked weights; our own reading back (``integers``) gives the codes again.
    The CUDA kernel's products themselves are tests/test_cuda.py's (on a GPU)."""
    g = torch.Generator().manual_seed(group)
    weight = quantize(torch.randn(2, 96, 512, generator=g), QuantScheme("nf4", group), torch.bfloat16)
    codes, reference = weight.integers(), weight.dequantize(torch.bfloat16)  # (2, 96, 512)
    nf4_linear.with_cuda_nf4_layout(weight)
    packed, scales = weight.packed
    assert weight.values is None and nf4_linear.nf4_layout(weight) == "cuda" and scales.dtype == torch.float32
    assert torch.equal(weight.integers(), codes) and torch.equal(weight.dequantize(torch.bfloat16), reference)
    read = bitsandbytes_cpu_reader()
    for expert in range(2):
        out = torch.empty(96, 512, dtype=torch.bfloat16)
        matrix, expert_scales = packed[expert].contiguous(), scales[expert].contiguous()
        read(matrix.data_ptr(), expert_scales.data_ptr(), out.data_ptr(), group, 96, 512)
        assert torch.equal(out, reference[expert])


@pytest.mark.parametrize("moe", [False, True], ids=["mistral", "mixtral"])
def test_the_cuda_layout_off_a_gpu_takes_the_reference_and_is_never_joined(monkeypatch, moe):
    """A model moved between devices keeps its layout: on a CPU, weights in the CUDA layout are
    multiplied by the reference (never by the CPU kernel, which reads another layout; experts
    too), and ``join_side_by_side`` leaves them apart: the same tokens and logprobs, exactly, as
    the same weights in the plain layout."""
    monkeypatch.setattr(nf4, "kernel", lambda: None)  # the plain layout, held by the reference
    plain = quantize_model(random_model(tiny_args(moe=moe), seed=4).to(torch.bfloat16), NF4_32)
    moved = copy.deepcopy(plain)
    for name, module in list(moved.named_modules()):
        if isinstance(module, QuantizedParameter):
            weight = QuantizedWeight(module.scheme, module.values.clone(), module.scales, module.in_features)
            install(moved, name, nf4_linear.with_cuda_nf4_layout(weight))
    monkeypatch.undo()  # the CPU kernel back, where this CPU has it
    join_side_by_side(moved)
    wq = moved.layers["0"].attention.wq.weight
    assert nf4_linear.nf4_layout(wq) == "cuda" and wq.values is None and wq.joined_rows is None
    x = torch.randn(3, wq.in_features).bfloat16()  # the op itself, off the GPU: the reference's product
    product = torch.ops.mixtral_infer.nf4_cuda_mm(x, *wq.packed, wq.scheme.group_size)
    assert torch.equal(product, reference_linear(x, plain.layers["0"].attention.wq.weight))
    prompts = random_prompts([5, WINDOW + 2], 128, seed=2)
    expected = generate(prompts, plain, max_tokens=WINDOW, decode="eager")
    assert generate(prompts, moved, max_tokens=WINDOW, decode="eager") == expected


@needs_kernel
def test_weights_of_one_input_are_joined_and_multiplied_in_one_call():
    """wq wk wv, and each expert's w1 w3, are one matrix of the kernel's layout (``join_side_by_side``):
    each weight's bytes a view of it, and ``linears`` multiplies the group in one call, giving the
    numbers of one call a weight exactly; a part of a group, or a group out of order, goes one by one."""
    model = quantize_model(random_model(tiny_args(moe=True), seed=5).to(torch.bfloat16), NF4_32)
    attention, moe = model.layers["0"].attention, model.layers["0"].feed_forward
    wq, wk, wv = attention.wq.weight, attention.wk.weight, attention.wv.weight
    assert [w.joined_rows for w in (wq, wk, wv)] == [(0, 64, 128), (64, 96, 128), (96, 128, 128)]
    assert wq.joined[0].shape == (128, 32) and wq.joined[1].shape == (2, 128) and wk.joined is None
    assert wk.packed[0].data_ptr() == wq.joined[0][64:].data_ptr()  # a view: no second copy
    assert moe.w1.joined[0].shape == (4, 192, 32) and moe.w3.joined_rows == (96, 192, 192)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    for together, alone in zip(linears(x, wq, wk, wv), [linear(x, w) for w in (wq, wk, wv)]):
        assert torch.equal(together, alone)
    e = torch.tensor(2)  # compiled code's expert index: the joined experts read in place
    alone = [linear(x[:1], moe.w1[2]), linear(x[:1], moe.w3[2])]
    for together, one in zip(linears(x[:1], moe.w1[e], moe.w3[e]), alone):
        assert torch.equal(together, one)
    assert joined_linear(x, [wq, wk]) is None and joined_linear(x, [wq, wv, wk]) is None
    assert joined_linear(x, [wq, attention.wo.weight]) is None  # wo is in no group
    assert joined_linear(x, [moe.w1[e], moe.w3[torch.tensor(2)]]) is None  # not provably one expert


def test_held_bytes_counts_views_once():
    """``held_bytes``' docstring example, a strided view, and a joined nf4 model: its weights' bytes
    counted once, as the same model's without joining (plus the joined scales, a second copy)."""
    w = torch.zeros(1000, dtype=torch.uint8)
    assert held_bytes([w, w[:300]]) == 1000 and held_bytes([w[:300], w[500:600]]) == 400
    stacked = torch.zeros(4, 6, 8, dtype=torch.bfloat16)
    assert held_bytes([stacked[:, 2:4], stacked]) == stacked.numel() * 2
    model = quantize_model(random_model(tiny_args(moe=True), seed=5).to(torch.bfloat16), NF4_32)
    apart = quantize_model(random_model(tiny_args(moe=True), seed=5).to(torch.bfloat16), "nf4-32")
    joined_scales = 0
    for module in apart.modules():
        if getattr(module, "joined_values", None) is not None:
            joined_scales += module.joined_scales.numel() * 2
            module.joined_values = module.joined_scales = None  # the views alone: bytes as before joining
    if nf4.kernel() is not None:
        assert joined_scales > 0
    assert weight_bytes(model) == weight_bytes(apart) + joined_scales
