"""kernels.linear.int_dots: int8 and int4 products through integer dot products (kernels/int_dots.cpp,
built here by kernels.native), against their integer arithmetic done readably, the weight-only product
within the stated bound, and whole models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import NATIVE_REASON, eager_and_compiled_decode, needs_kernels, random_model, tiny_args

from mixtral_infer.fast.int4_inline import inline_scale_values, inline_scales, plain_values, row_bytes
from mixtral_infer.formats import measured
from mixtral_infer.formats.modules import use_formats
from mixtral_infer.formats.quantizing import quantize_model
from mixtral_infer.kernels import native
from mixtral_infer.kernels.linear import Int8Linear, IntDotsLinear, backend_for, prepare_weight
from mixtral_infer.kernels.linear.int_dots import activation_error_bound, available, quantized_blocks, reference_int_dots
from mixtral_infer.quant.scheme import QuantScheme
from mixtral_infer.quant.weights import QuantizedWeight, quantize
from mixtral_infer.tuning import Tuning

DOTS = Tuning(int_dots=True)
SCHEMES = [QuantScheme("int8"), QuantScheme("int4", 32), QuantScheme("int4", 64), QuantScheme("int4", 128)]


def test_the_docstring_example():
    """``x = [0.5, -1.0, 0.25, 0...]`` quantizes to ``[64, -127, 32, 0...]`` (63.5 to the even 64) with
    ``d = 1/127``; an int8 row ``[2, 1, -4, 0...]`` of scale 0.1 gives -0.1, and with ``x[0] = 0.51``,
    ``0.1 * (130 - 127 - 128) / 127``."""
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([0.5, -1.0, 0.25])
    q, d = quantized_blocks(x)
    assert q[0, 0, :4].tolist() == [64, -127, 32, 0] and d.item() == pytest.approx(1 / 127)
    values = torch.zeros(1, 32, dtype=torch.int8)
    values[0, :3] = torch.tensor([2, 1, -4], dtype=torch.int8)
    weight = QuantizedWeight(QuantScheme("int8"), values, torch.tensor([0.1]), 32)
    assert reference_int_dots(x, weight).item() == pytest.approx(-0.1, rel=1e-6)
    x[0, 0] = 0.51
    assert reference_int_dots(x, weight).item() == pytest.approx(0.1 * (130 - 127 - 128) / 127, rel=1e-6)
    if NATIVE_REASON is None and available():
        assert IntDotsLinear.product(x, weight).item() == pytest.approx(0.1 * -125 / 127, rel=1e-6)


def test_the_inline_layout_s_worked_example():
    """``fast.int4_inline``'s example: a row of 320 inputs in groups of 32 with bfloat16 scales is 2
    chunks of 144 bytes, chunk 0 ``s[0..7]`` and bytes 0-127, chunk 1 ``s[8], s[9]``, six zero scales,
    bytes 128-159 and 96 zero bytes; the plain values and scales read back as they were."""
    torch.manual_seed(5)
    weight = quantize(torch.randn(3, 320), QuantScheme("int4", 32), torch.bfloat16)
    rows = inline_scales(weight.values, weight.scales, 32)
    assert rows.shape == (3, 288) and row_bytes(320, 32, 2) == 288
    first, second = rows[:, :144], rows[:, 144:]
    assert torch.equal(first[:, :16].contiguous().view(torch.bfloat16), weight.scales[:, :8])
    assert torch.equal(first[:, 16:], weight.values[:, :128])
    assert torch.equal(second[:, :4].contiguous().view(torch.bfloat16), weight.scales[:, 8:10]) and (second[:, 4:16] == 0).all()
    assert torch.equal(second[:, 16:48], weight.values[:, 128:160]) and (second[:, 48:] == 0).all()
    assert torch.equal(plain_values(rows, 320, 32), weight.values)
    assert torch.equal(inline_scale_values(rows, 320, 32), weight.scales)


@needs_kernels
@pytest.mark.parametrize("group", [32, 64, 256])
def test_scales_that_are_not_bfloat16_are_kept_as_float32_and_read_so(group):
    """Scales that bfloat16 cannot hold (a GGUF file's float16 ones) are kept as float32, 4 bytes each:
    the kernel reads them so (its product is the integer arithmetic with the exact scales, where
    bfloat16 ones would move it by about 0.2%), and they read back exactly."""
    torch.manual_seed(6)
    weight = quantize(torch.randn(40, 512), QuantScheme("int4", group), torch.float32)
    weight.scales = (weight.scales * (1 + 2**-10)).half().float()  # float16 numbers, most not bfloat16 ones
    rows = inline_scales(weight.values, weight.scales, group)
    assert rows.shape == (40, row_bytes(512, group, 4)) and torch.equal(inline_scale_values(rows, 512, group), weight.scales)
    x = torch.randn(3, 512)
    got = IntDotsLinear.product(x, weight).double()
    exact = reference_int_dots(x, weight)
    assert ((got - exact).abs() <= torch.finfo(torch.float32).eps * exact.abs() + 1e-4).all()
    rounded = QuantizedWeight(weight.scheme, weight.values, weight.scales.bfloat16().float(), 512)
    assert ((reference_int_dots(x, rounded) - exact).abs() > 1e-3).any()  # the bound above tells them apart


@needs_kernels
def test_loading_lays_int4_out_with_its_scales_inline_and_the_integers_read_back():
    """``prepare_weight`` under ``int_dots``: stacked int4 experts become rows with their scales inline,
    the plain values dropped; the integers read back as they were, and an expert given as a 0-d index
    multiplies as the weight laid out for the call does, bit for bit. int8 keeps its plain layout."""
    torch.manual_seed(7)
    weight = quantize(torch.randn(3, 64, 320), QuantScheme("int4", 64), torch.bfloat16)
    plain, integers = QuantizedWeight(weight.scheme, weight.values, weight.scales, 320), weight.integers()
    prepare_weight(weight, DOTS)
    assert weight.values is None and weight.holds_inline_scales() and weight.packed[0].shape == (3, 64, row_bytes(320, 64, 2))
    assert torch.equal(weight.integers(), integers) and backend_for(weight, DOTS) is IntDotsLinear
    x = torch.randn(5, 320, dtype=torch.bfloat16)
    assert torch.equal(IntDotsLinear.product(x, weight[torch.tensor(1)]), IntDotsLinear.product(x, plain[1]))
    int8 = quantize(torch.randn(64, 320), QuantScheme("int8"), torch.bfloat16)
    values = int8.values
    prepare_weight(int8, DOTS)
    assert int8.values is values and int8.packed is None


@needs_kernels
def test_experts_laid_out_with_scales_of_two_widths_stack_and_other_widths_of_x_are_refused():
    """Experts laid out one by one (a GGUF file's tensors), one with bfloat16 scales and one with
    float16 ones, stack in one width (float32 scales), each expert's product unchanged; rows of another
    number of inputs than the weight's (320 against 384, the same chunks) are refused, not multiplied."""
    from mixtral_infer.checkpoint.quantized import stack

    torch.manual_seed(8)
    parts = [quantize(torch.randn(16, 384), QuantScheme("int4", 32), torch.float32) for _ in range(2)]
    parts[1].scales = (parts[1].scales * (1 + 2**-10)).half().float()
    x = torch.randn(2, 384)
    alone = [IntDotsLinear.product(x, p) for p in parts]
    for p in parts:
        prepare_weight(p, DOTS)
    assert parts[0].packed[0].shape != parts[1].packed[0].shape
    stacked = stack(parts)
    assert stacked.packed[0].shape == (2, 16, row_bytes(384, 32, 4))
    for e in range(2):
        assert torch.equal(IntDotsLinear.product(x, stacked[torch.tensor(e)]), alone[e])
    with pytest.raises(RuntimeError, match=r"x must be \(rows, 384\)"):
        IntDotsLinear.product(torch.randn(1, 320), parts[0])


@needs_kernels
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_int4_quantized_under_another_tuning_is_laid_out_once_when_swapped_in(moe):
    """A model quantized under the default tuning (int4 in the plain layout), then given ``int_dots``
    (``use_formats``): each int4 weight, Mixtral's stacked experts too, is laid out with its scales
    inline then, not at every product, and the logits are the model's quantized under ``int_dots``."""
    swapped = use_formats(model(moe, "int4-32", Tuning()), DOTS)
    quantized = [m for m in swapped.modules() if isinstance(m, QuantizedWeight)]
    assert quantized and all(m.values is None and m.holds_inline_scales() for m in quantized)
    tokens = torch.randint(0, 128, (9,))
    assert torch.equal(prompt_logits(swapped, tokens), prompt_logits(model(moe, "int4-32", DOTS), tokens))


@needs_kernels
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 11, 38])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_product_is_its_integer_arithmetic_and_within_the_bound(scheme, rows, dtype):
    """The kernel equals the quantized activations times the dequantized weight summed in float64 (to
    float32's rounding), and stays within ``activation_error_bound`` of the weight-only product; 1152
    inputs (int4 reads 256 at a time, then the last 128), 4099 rows of weights (not a multiple of the
    4 read at once, nor of a prompt's panels), decoding's passes (1 to 8 rows) and a prompt's panels
    (11: two tiles of 4 rows and a tail of 3; 38: nine tiles and a tail of 2)."""
    torch.manual_seed(rows)
    weight = quantize(torch.randn(4099, 1152), scheme, dtype)
    x = torch.randn(rows, 1152).to(dtype)
    got = IntDotsLinear.product(x, weight).double()  # (rows, OUT)
    assert got.shape == (rows, 4099)
    exact = reference_int_dots(x, weight)
    rounding = torch.finfo(dtype).eps * exact.abs() + 1e-4
    assert ((got - exact).abs() <= rounding).all()
    weight_only = x.double() @ weight.dequantize(torch.float64).T
    assert ((got - weight_only).abs() <= activation_error_bound(x, weight) + rounding).all()
    assert (got - weight_only).abs().max() > 0  # it does quantize the activations


@needs_kernels
@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.label)
def test_a_row_is_the_same_in_any_batch_and_an_expert_is_read_in_place(scheme):
    """Row m of a batch of 7 is the row alone, bit for bit; expert 2 of stacked weights, given as a 0-d
    index (compiled code's routing), is that expert's own product."""
    torch.manual_seed(1)
    stacked = quantize(torch.randn(3, 96, 128), scheme, torch.bfloat16)
    x = torch.randn(7, 128, dtype=torch.bfloat16)
    alone = [IntDotsLinear.product(x[m : m + 1], stacked[2]) for m in range(7)]
    assert torch.equal(IntDotsLinear.product(x, stacked[2]), torch.cat(alone))
    expert = stacked[torch.tensor(2)]
    assert expert.expert is not None
    assert torch.equal(IntDotsLinear.product(x, expert), IntDotsLinear.product(x, stacked[2]))


@needs_kernels
@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.label)
@pytest.mark.parametrize("rows", [2, 12], ids=["pass", "panels"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_activation_makes_its_row_nan(bad, rows, scheme):
    """As the weight-only product does: the row holding it is NaN in every output, the other rows are not."""
    weight = quantize(torch.randn(8, 256), scheme, torch.float32)
    x = torch.randn(rows, 256)
    x[0, 3] = bad
    got = IntDotsLinear.product(x, weight)
    assert got[0].isnan().all() and got[1:].isfinite().all()


@needs_kernels
@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.label)
def test_a_block_too_small_to_scale_counts_as_zeros_and_no_inputs_give_zeros(scheme):
    """127 / max|x| overflows for a block of activations below about 7e-37: its integers are 0, in the
    readable form and the kernel (which made them -128, the integer conversion of inf, outside the
    |q| <= 127 its 16-bit sums rely on; only the tiny scale hid it). A chunk with no inputs gives zeros
    (the panels' size divided by the rows' zero width: the process died of SIGFPE)."""
    torch.manual_seed(4)
    weight = quantize(torch.randn(8, 64), scheme, torch.float32)
    x = torch.randn(12, 64)
    x[:, :32] = 1e-38 * torch.sign(x[:, :32])
    q, _ = quantized_blocks(x)
    assert (q[:, 0] == 0).all()
    got = IntDotsLinear.product(x, weight)
    skipped = x.clone()
    skipped[:, :32] = 0
    torch.testing.assert_close(got.double(), reference_int_dots(skipped, weight), atol=1e-4, rtol=1e-6)
    if scheme.name == "int8":
        empty = QuantizedWeight(scheme, torch.zeros(8, 0, dtype=torch.int8), torch.ones(8), 0)
        assert torch.equal(IntDotsLinear.product(torch.zeros(12, 0), empty), torch.zeros(12, 8))


@needs_kernels
def test_a_prompt_chunk_is_each_row_alone_and_int8_may_take_the_weight_only_product():
    """A prompt chunk (``DOTS_ROWS`` rows, in panels) is each row as it is alone, bit for bit, for int8
    and int4; ``Tuning.int_dots_prompts=False`` (the machine measured it faster) hands int8 chunks of
    ``DOTS_ROWS`` rows to int8's weight-only product, bit for bit, and fewer rows stay with the kernel."""
    from mixtral_infer.kernels.linear.int_dots import DOTS_ROWS

    torch.manual_seed(0)
    x = torch.randn(DOTS_ROWS, 128, dtype=torch.bfloat16)
    for scheme in (QuantScheme("int4", 32), QuantScheme("int8")):
        weight = quantize(torch.randn(64, 128), scheme, torch.bfloat16)
        alone = torch.cat([IntDotsLinear.product(x[m : m + 1], weight) for m in range(DOTS_ROWS)])
        assert torch.equal(IntDotsLinear.product(x, weight), alone)
    weight_only = Tuning(int_dots=True, int_dots_prompts=False)
    assert torch.equal(IntDotsLinear.product(x, weight, weight_only), Int8Linear.product(x, weight))
    fewer = x[: DOTS_ROWS - 1]
    assert torch.equal(IntDotsLinear.product(fewer, weight, weight_only), IntDotsLinear.product(fewer, weight))


@needs_kernels
@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.label)
def test_float16_and_float64_activations_quantize_as_their_float32_values(scheme):
    """The activations are read in their own dtype (float16 through F16C, float64 converted): the
    products are those of the same values in float32, in the activations' dtype."""
    torch.manual_seed(2)
    weight = quantize(torch.randn(40, 256), scheme, torch.bfloat16)
    for dtype in (torch.float16, torch.float64):
        x = torch.randn(13, 256).to(dtype)
        got = IntDotsLinear.product(x, weight)
        assert got.dtype == dtype
        assert torch.equal(got, IntDotsLinear.product(x.float(), weight).to(dtype))


def model(moe: bool, scheme: str, tuning: Tuning, dtype: torch.dtype = torch.float32):
    args = dataclasses.replace(tiny_args(moe=moe), dim=128, hidden_dim=192, head_dim=32)
    m = random_model(args, seed=3).to(dtype)
    use_formats(m, tuning)  # the layouts quantize_model prepares follow the model's tuning
    quantize_model(m, scheme)
    return use_formats(m, tuning)


def prompt_logits(m, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of ``tokens`` as one prompt through ``m`` (a cache of one row)."""
    with torch.inference_mode():
        cache = m.make_cache(1)
        cache.start_sequences(1)
        return m(tokens, [len(tokens)], cache)


@needs_kernels
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("scheme", ["int8", "int4-32"])
def test_a_model_reads_every_quantized_weight_through_it(moe, scheme):
    """With ``Tuning(int_dots=True)`` every quantized linear layer (and Mixtral's experts) is this
    back-end, int4 with its scales inline and no plain values; the logits are the weight-only model's
    within what int8 activations move (a few percent of this random model's logits), and not equal to them."""
    dots, weight_only = model(moe, scheme, DOTS), model(moe, scheme, Tuning())
    linears = [m for m in dots.modules() if isinstance(m, torch.nn.Linear) and not isinstance(m.weight, torch.Tensor)]
    assert linears and all(isinstance(m, IntDotsLinear) for m in linears)
    quantized = [m for m in dots.modules() if isinstance(m, QuantizedWeight)]
    assert all((m.values is None and m.holds_inline_scales()) == (scheme != "int8") for m in quantized)
    if moe:
        assert {b.__name__ for layer in dots.layers.values() for b in layer.feed_forward.expert_backends.values()} == {"IntDotsLinear"}
    tokens = torch.randint(0, 128, (20,))
    logits = [prompt_logits(m, tokens).float() for m in (dots, weight_only)]
    scale = logits[1].abs().max()
    difference = (logits[0] - logits[1]).abs().max()
    assert 0 < difference < 0.1 * scale


@needs_kernels
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_folder_quantized_to_int4_while_loading_is_laid_out_for_it(tmp_path, moe):
    """``load_model(quantize="int4")`` under ``int_dots``: each weight laid out as it is read (before the
    model has its tuning, when int4's back-end holds it), every layer this back-end at the end, with
    the logits of the same model quantized in memory, bit for bit."""
    from mixtral_infer.checkpoint.loading import load_model, save_consolidated

    args = dataclasses.replace(tiny_args(moe=moe), dim=128, hidden_dim=192, head_dim=32)
    save_consolidated(random_model(args, seed=3), tmp_path)
    loaded = load_model(tmp_path, dtype=torch.float32, quantize="int4", tuning=DOTS)
    quantized = [m for m in loaded.modules() if isinstance(m, QuantizedWeight)]
    assert quantized and all(m.values is None and m.holds_inline_scales() for m in quantized)
    linears = [m for m in loaded.modules() if isinstance(m, torch.nn.Linear) and not isinstance(m.weight, torch.Tensor)]
    assert linears and all(isinstance(m, IntDotsLinear) for m in linears)
    tokens = torch.randint(0, 128, (9,))
    assert torch.equal(prompt_logits(loaded, tokens), prompt_logits(model(moe, "int4-32", DOTS), tokens))


@needs_kernels
@pytest.mark.parametrize("scheme", ["int8", "int4-32"])
def test_compiled_decoding_calls_the_operator_and_equals_eager(scheme):
    """A compiled step (torch.compile) calls the operator (its fake implementation gives the shapes) for
    every quantized product, int4 on its rows with their scales inline, and gives the eager step's logits."""
    dots = model(False, scheme, DOTS)
    expected, got, codes = eager_and_compiled_decode(dots, DOTS)
    op = "int8_dots" if scheme == "int8" else "int4_dots"
    calls = sum(code.count(f"torch.ops.mixtral_infer_dots.{op}.default(") for code in codes)
    assert calls == sum(isinstance(m, IntDotsLinear) for m in dots.modules()) > 0  # one call a quantized product
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


SAVED_MODEL_SCRIPT = """
import sys, torch
for model_file, logits_file in zip(sys.argv[1::2], sys.argv[2::2]):
    model = torch.load(model_file, weights_only=False)
    print(sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear) and not isinstance(m.weight, torch.Tensor)}))
    with torch.inference_mode():
        cache = model.make_cache(1)
        cache.start_sequences(1)
        torch.save(model(torch.arange(1, 12), [11], cache), logits_file)
"""
SAVED_CASES = [(moe, scheme, dtype) for moe in (False, True)
               for scheme, dtype in (("int8", torch.float32), ("int4-32", torch.float32), ("int4-32", torch.bfloat16))]  # fmt: skip


@needs_kernels
def test_a_saved_model_decodes_in_a_new_process_with_or_without_the_kernels(tmp_path):
    """``torch.save`` of a model under ``int_dots``, read in another process: its layers load the
    operators there and give the same logits; where the kernels cannot be loaded
    (``MIXTRAL_INFER_NATIVE=0``) the weights are laid out for the weight-only back-ends (int4 in
    bfloat16: the CPU kernel's layout) and give the weight-only model's logits. Dense and Mixtral,
    int8, int4 and int4 in bfloat16: one process reads all six, with the kernels and without."""
    import os
    import subprocess
    import sys

    def logits(m):
        return prompt_logits(m, torch.arange(1, 12))

    def backends(m):
        return sorted({type(m).__name__ for m in m.modules() if isinstance(m, torch.nn.Linear) and not isinstance(m.weight, torch.Tensor)})

    expected = {True: [], False: []}  # native on: the kernel model's (logits, back-ends); off: the weight-only model's
    files = []
    for index, (moe, scheme, dtype) in enumerate(SAVED_CASES):
        dots, weight_only = model(moe, scheme, DOTS, dtype), model(moe, scheme, Tuning(), dtype)
        torch.save(dots, tmp_path / f"model{index}.pt")
        files += [str(tmp_path / f"model{index}.pt"), str(tmp_path / f"logits{index}.pt")]
        expected[True].append((logits(dots), backends(dots)))
        expected[False].append((logits(weight_only), backends(weight_only)))
    for native_on in (True, False):
        env = {**os.environ, native.NATIVE_VARIABLE: "1" if native_on else "0"}
        run = subprocess.run([sys.executable, "-c", SAVED_MODEL_SCRIPT, *files], capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr
        for index, (line, (logits_expected, names)) in enumerate(zip(run.stdout.splitlines(), expected[native_on], strict=True)):
            case = (SAVED_CASES[index], "native" if native_on else "no native")
            assert line == str(names), case
            torch.testing.assert_close(torch.load(tmp_path / f"logits{index}.pt"), logits_expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{case}: {m}")
    assert "native kernels not used: MIXTRAL_INFER_NATIVE=0" in run.stderr


def test_without_the_kernels_the_weight_only_back_ends_read_the_weights(monkeypatch):
    """``MIXTRAL_INFER_NATIVE=0`` (or no compiler, no AVX2...): one reason, and int8 weights stay with
    their weight-only back-end under ``Tuning(int_dots=True)``."""
    monkeypatch.setenv(native.NATIVE_VARIABLE, "0")
    assert native.unavailable_because() == "MIXTRAL_INFER_NATIVE=0"
    monkeypatch.setattr(native, "_STATE", {})
    weight = quantize(torch.randn(64, 128), QuantScheme("int8"), torch.bfloat16)
    assert backend_for(weight, DOTS) is Int8Linear
    monkeypatch.delenv(native.NATIVE_VARIABLE)
    monkeypatch.setattr(native, "cpu_flags", lambda: "fpu sse2 avx")
    assert native.unavailable_because() == "this CPU has no AVX2"


def test_the_machine_measures_the_choice_only_for_integer_weights(tmp_path, monkeypatch):
    """``machine_tuning(integers=True)`` (int8 or int4 weights on CPU) adds the ``int_dots`` choice,
    measured once and kept; without it the choice is neither measured nor set. The prompts' choice
    is timed only where the dot products are chosen (``int_dot_prompts_are_faster`` is then asked)."""
    monkeypatch.setenv(measured.MEASURE_VARIABLE, "1")
    asked, prompts = [], []
    monkeypatch.setattr(measured, "CHOICES", ())
    monkeypatch.setattr(measured, "INT_DOTS", measured.Choice("int_dots", lambda known: asked.append(1) or True))
    # capable on any machine, as the two above (the real ones ask whether the library can be built)
    monkeypatch.setattr(measured, "INT_DOT_PROMPTS", measured.Choice("int_dots_prompts", measured.INT_DOT_PROMPTS.measure))
    monkeypatch.setattr(measured, "int_dot_prompts_are_faster", lambda tuning: prompts.append(tuning) or False)
    path, quiet = tmp_path / "tuning.json", lambda line: None
    assert not measured.machine_tuning(path=path, announce=quiet).int_dots and asked == []
    tuning = measured.machine_tuning(path=path, announce=quiet, integers=True)
    assert tuning.int_dots and not tuning.int_dots_prompts and asked == [1] and len(prompts) == 1
    assert measured.machine_tuning(path=path, announce=quiet, integers=True).int_dots and asked == [1]  # kept
    monkeypatch.setattr(measured, "INT_DOTS", measured.Choice("int_dots", lambda known: False))
    other = tmp_path / "other.json"
    assert not measured.machine_tuning(path=other, announce=quiet, integers=True).int_dots_prompts and len(prompts) == 1
