"""kernels/float_dots.cpp (``Tuning.float_dots``, kernels.linear.plain): float32 products of a few rows
against the float64 product within float32's rounding, each row the same in any batch, the products it
takes in a model and those it leaves, and where the machine measures it; its bfloat16 products
(``Tuning.bfloat16_dots``) against the float32 ones of the widened numbers."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import eager_and_compiled_decode, needs_kernels, random_model, tiny_args

from mixtral_infer.formats import measured
from mixtral_infer.formats.modules import use_formats
from mixtral_infer.kernels import native
from mixtral_infer.kernels.linear import plain
from mixtral_infer.kernels.linear.plain import PlainLinear
from mixtral_infer.tuning import Tuning

FLOAT_DOTS = Tuning(float_dots=True)


def float_dots(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mixtral_infer_dots.float_dots(x, weight)


def rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far a float32 sum of IN products may be from the exact one: IN * 2^-24 * sum |x| |w| (a
    loose form of the usual bound for a sum computed in any order)."""
    return x.shape[1] * 2.0**-24 * (x.abs().double() @ weight.abs().double().T)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11])
# (OUT, IN): OUT not a multiple of the 4 or 2 weight rows a set; IN not a multiple of 8 (the tail's
# scalar sums); IN under 8 (the tail alone)
@pytest.mark.parametrize("shape", [(37, 1030), (10, 13), (6, 5)], ids=["37x1030", "10x13", "6x5"])
def test_each_product_is_within_float32_rounding_of_the_exact_one(rows, shape):
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, shape[1], generator=g), torch.randn(*shape, generator=g)
    got = float_dots(x, weight)
    exact = x.double() @ weight.double().T
    assert got.shape == (rows, shape[0]) and got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= rounding_bound(x, weight)).all()


@needs_kernels
def test_a_row_is_the_same_in_any_batch_and_a_stacked_expert_is_read_in_place():
    """Each output is the same sequence of fused multiply-adds whatever the rows beside it (1-4 rows
    against sets of 4 or 2 weight rows, 5-8 as 4 and the rest in panels), so a row alone and in a batch of 8
    agree bit for bit; an expert of stacked weights (a view) is read where it lies."""
    g = torch.Generator().manual_seed(0)
    x, experts = torch.randn(8, 1030, generator=g), torch.randn(3, 37, 1030, generator=g)
    batch = float_dots(x, experts[1])
    for m in range(8):
        assert torch.equal(float_dots(x[m : m + 1], experts[1]), batch[m : m + 1])
    for n in range(1, 8):  # every batch size: 1-4 rows set by set, 5-8 in panels
        assert torch.equal(float_dots(x[8 - n :], experts[1]), batch[8 - n :])
    assert torch.equal(batch, float_dots(x, experts[1].clone()))


@needs_kernels
def test_no_rows_and_no_inputs():
    assert float_dots(torch.empty(0, 16), torch.randn(5, 16)).shape == (0, 5)
    assert torch.equal(float_dots(torch.empty(3, 0), torch.empty(5, 0)), torch.zeros(3, 5))


@needs_kernels
def test_bad_operands_say_what_is_expected():
    with pytest.raises(RuntimeError, match="float32 x and weight expected"):
        float_dots(torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(5, 16))
    with pytest.raises(RuntimeError, match="contiguous"):
        float_dots(torch.randn(2, 16), torch.randn(16, 5).T)
    with pytest.raises(RuntimeError, match=r"x must be \(rows, 16\)"):
        float_dots(torch.randn(2, 15), torch.randn(5, 16))


@needs_kernels
def test_plain_linear_takes_it_for_a_few_float32_rows_and_leaves_the_rest_to_torch(monkeypatch):
    """Under ``Tuning(float_dots=True)`` up to 8 float32 rows times a contiguous float32 weight are the
    operator's; 9 rows, a weight that is a transposed view, 16-bit inputs and inputs recording a
    gradient are ``F.linear``'s, bit for bit."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(37, 1030, generator=g)
    x = torch.randn(9, 1030, generator=g)
    taken = []
    monkeypatch.setattr(plain, "takes_float_dots", lambda x, w, takes=plain.takes_float_dots: taken.append(takes(x, w)) or taken[-1])
    few = PlainLinear.product(x[:8], weight, FLOAT_DOTS)
    assert taken == [True] and torch.equal(few, float_dots(x[:8], weight))
    assert torch.equal(PlainLinear.product(x, weight, FLOAT_DOTS), F.linear(x, weight))
    transposed = weight.T.contiguous().T
    assert torch.equal(PlainLinear.product(x[:2], transposed, FLOAT_DOTS), F.linear(x[:2], transposed))
    half = x[:2].bfloat16(), weight.bfloat16()
    assert torch.equal(PlainLinear.product(*half, FLOAT_DOTS), F.linear(*half))
    learning = x[:2].clone().requires_grad_()
    y = PlainLinear.product(learning, weight, FLOAT_DOTS)
    y.sum().backward()
    assert torch.equal(y.detach(), F.linear(x[:2], weight))
    torch.testing.assert_close(learning.grad, weight.sum(0).expand(2, -1))
    assert taken == [True, False, False, False]  # 9 rows do not ask: prompt-sized products go to float32_linear


@needs_kernels
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_float32_model_decodes_through_it_as_without_it(moe, monkeypatch):
    """A float32 model under ``Tuning(float_dots=True)`` sends its decoding products (attention, the
    dense feed-forward, the output; a Mixtral's experts go to the experts operator) to the kernel and
    gives the logits of the same model without it, to float32 rounding."""
    taken = []

    def counted(x, weight):
        took = takes(x, weight)
        taken.append((x.shape[0], took))
        return took

    takes = plain.takes_float_dots
    monkeypatch.setattr(plain, "takes_float_dots", counted)
    reference = random_model(tiny_args(moe=moe), seed=5)
    fast = use_formats(copy.deepcopy(reference), FLOAT_DOTS)
    prompts = [torch.randint(0, 128, (12,)), torch.randint(0, 128, (12,)), torch.randint(0, 128, (12,))]
    logits = []
    for model in (fast, reference):
        with torch.inference_mode():
            cache = model.make_cache(3)
            cache.start_sequences(3)
            model(torch.cat(prompts), [12] * 3, cache)
            steps = [model(torch.tensor([1, 2, 3]), [1] * 3, cache) for _ in range(3)]
        logits.append(torch.stack(steps))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)
    assert any(took for _, took in taken) and all(rows <= 8 for rows, took in taken if took)


def test_the_machine_measures_the_choice_only_for_float32_weights(tmp_path, monkeypatch):
    """``machine_tuning(floats=True)`` (float32 weights on CPU) adds the ``float_dots`` choice, measured
    once and kept, after the few-row blocks it is weighed against (``float_dots_are_faster`` is given
    the tuning with them); without it the choice is neither measured nor set."""
    monkeypatch.setenv(measured.MEASURE_VARIABLE, "1")
    asked = []
    monkeypatch.setattr(measured, "CHOICES", (measured.Choice("few_row_blocks", lambda known: True),))
    # capable on any machine (the real choice asks whether the library can be built)
    monkeypatch.setattr(measured, "FLOAT_DOTS", measured.Choice("float_dots", measured.FLOAT_DOTS.measure))
    monkeypatch.setattr(measured, "float_dots_are_faster", lambda tuning: asked.append(tuning) or True)
    path, quiet = tmp_path / "tuning.json", lambda line: None
    assert not measured.machine_tuning(path=path, announce=quiet).float_dots and asked == []
    tuning = measured.machine_tuning(path=path, announce=quiet, floats=True)
    assert tuning.float_dots and tuning.few_row_blocks and len(asked) == 1 and asked[0].few_row_blocks
    assert measured.machine_tuning(path=path, announce=quiet, floats=True).float_dots and len(asked) == 1  # kept


def test_without_the_library_the_choice_is_off_and_not_kept(tmp_path, monkeypatch):
    """Where the library cannot be built for now (``MIXTRAL_INFER_NATIVE=0`` here; no compiler or ninja
    elsewhere) ``float_dots`` is off for the process and nothing is kept, so a later process that can
    build it measures it; the choices that need no library are kept as usual."""
    monkeypatch.setenv(measured.MEASURE_VARIABLE, "1")
    monkeypatch.setattr(measured, "CHOICES", (measured.Choice("few_row_blocks", lambda known: True),))
    monkeypatch.setattr(measured, "float_dots_are_faster", lambda tuning: True)
    path, quiet = tmp_path / "tuning.json", lambda line: None
    monkeypatch.setenv(native.NATIVE_VARIABLE, "0")
    monkeypatch.setattr(native, "loaded", lambda: pytest.fail("the library was asked for"))
    tuning = measured.machine_tuning(path=path, announce=quiet, floats=True)
    assert not tuning.float_dots and tuning.few_row_blocks
    assert list(json.loads(path.read_text()).values()) == [{"few_row_blocks": True}]
    monkeypatch.delenv(native.NATIVE_VARIABLE)
    monkeypatch.setattr(native, "unavailable_because", lambda: None)  # a process that can build it
    assert measured.machine_tuning(path=path, announce=quiet, floats=True).float_dots
    assert list(json.loads(path.read_text()).values()) == [{"few_row_blocks": True, "float_dots": True}]


@pytest.mark.parametrize("why", ["cpu", "build"])
def test_a_cpu_without_avx2_or_a_failed_build_keeps_the_choice_off_and_is_not_tried_again(tmp_path, monkeypatch, why):
    """A CPU without AVX2 keeps ``float_dots: false`` without asking for the library (no build, no line
    on stderr); a build that fails is asked for once and its answer kept, not built again by every
    process."""
    monkeypatch.setenv(measured.MEASURE_VARIABLE, "1")
    monkeypatch.setattr(measured, "CHOICES", ())
    asked = []
    if why == "cpu":
        monkeypatch.setattr(native, "cpu_flags", lambda: "fpu sse2 avx")
    else:
        monkeypatch.setattr(native, "unavailable_because", lambda: None)
    monkeypatch.setattr(native, "loaded", lambda: asked.append(1) or False)  # the build fails
    path, quiet = tmp_path / "tuning.json", lambda line: None
    for _ in range(2):
        assert not measured.machine_tuning(path=path, announce=quiet, floats=True).float_dots
    assert list(json.loads(path.read_text()).values()) == [{"float_dots": False}]
    assert len(asked) == (0 if why == "cpu" else 1)


BFLOAT16_DOTS = Tuning(bfloat16_dots=True)


def bfloat16_dots(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mixtral_infer_dots.bfloat16_dots(x, weight)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("shape", [(37, 1030), (10, 13), (6, 5)], ids=["37x1030", "10x13", "6x5"])
def test_a_bfloat16_product_is_the_float32_one_of_its_widened_numbers_rounded_once(rows, shape):
    """Widening a bfloat16 number to float32 is exact (its bits are a float32's upper half), so the
    bfloat16 product is ``float_dots`` of the widened operands, bit for bit, rounded to bfloat16 once:
    within a bfloat16 rounding (2^-8 relative) of the float32 sum, itself within float32's rounding
    of the exact product."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, shape[1], generator=g).bfloat16()
    weight = torch.randn(*shape, generator=g).bfloat16()
    got = bfloat16_dots(x, weight)
    assert got.shape == (rows, shape[0]) and got.dtype == torch.bfloat16
    assert torch.equal(got, float_dots(x.float(), weight.float()).bfloat16())
    exact = x.double() @ weight.double().T
    bound = rounding_bound(x.float(), weight.float())
    assert ((got.double() - exact).abs() <= 2.0**-8 * (exact.abs() + bound) + bound).all()


@needs_kernels
def test_bad_bfloat16_operands_say_what_is_expected():
    with pytest.raises(RuntimeError, match="bfloat16 x and weight expected"):
        bfloat16_dots(torch.randn(2, 16), torch.randn(5, 16).bfloat16())
    with pytest.raises(RuntimeError, match="contiguous"):
        bfloat16_dots(torch.randn(2, 16).bfloat16(), torch.randn(16, 5).bfloat16().T)


@needs_kernels
def test_a_bfloat16_model_decodes_through_it_and_leaves_prompts_and_other_dtypes_to_torch(monkeypatch):
    """Under ``Tuning(bfloat16_dots=True)`` a bfloat16 model's decoding products (up to 8 rows) are the
    kernel's, its prompt's are not, and its logits are those of the same model without it within
    bfloat16's rounding; float32 rows stay off it."""
    taken = []

    def counted(x, weight, dtype=torch.float32):
        took = takes(x, weight, dtype)
        taken.append((x.shape[0], dtype, took))
        return took

    takes = plain.takes_float_dots
    monkeypatch.setattr(plain, "takes_float_dots", counted)
    reference = random_model(tiny_args(moe=False), seed=5).to(torch.bfloat16)
    fast = use_formats(copy.deepcopy(reference), BFLOAT16_DOTS)
    prompts = [torch.randint(0, 128, (12,)) for _ in range(3)]
    logits = []
    for model in (fast, reference):
        with torch.inference_mode():
            cache = model.make_cache(3)
            cache.start_sequences(3)
            model(torch.cat(prompts), [12] * 3, cache)
            steps = [model(torch.tensor([1, 2, 3]), [1] * 3, cache) for _ in range(3)]
        logits.append(torch.stack(steps).float())
    torch.testing.assert_close(logits[0], logits[1], atol=0.05, rtol=0.02)
    took = [(rows, dtype) for rows, dtype, took in taken if took]
    assert took and all(rows <= 8 and dtype == torch.bfloat16 for rows, dtype in took)
    assert any(rows == 36 and not took for rows, _, took in taken)  # the prompt's 36 rows were asked, not taken
    x, weight = torch.randn(2, 16), torch.randn(5, 16)
    assert torch.equal(PlainLinear.product(x, weight, BFLOAT16_DOTS), F.linear(x, weight))


def test_the_machine_measures_the_bfloat16_choice_only_for_bfloat16_weights(tmp_path, monkeypatch):
    """``machine_tuning(bfloat16=True)`` (plain bfloat16 weights on CPU, as ``load_model`` says) adds
    the ``bfloat16_dots`` choice, measured once and kept; without it the choice is neither measured nor set."""
    monkeypatch.setenv(measured.MEASURE_VARIABLE, "1")
    asked = []
    monkeypatch.setattr(measured, "CHOICES", ())
    monkeypatch.setattr(measured, "BFLOAT16_DOTS", measured.Choice("bfloat16_dots", measured.BFLOAT16_DOTS.measure))
    monkeypatch.setattr(measured, "bfloat16_dots_are_faster", lambda tuning: asked.append(tuning) or True)
    path, quiet = tmp_path / "tuning.json", lambda line: None
    assert not measured.machine_tuning(path=path, announce=quiet, floats=True).bfloat16_dots and asked == []
    assert measured.machine_tuning(path=path, announce=quiet, bfloat16=True).bfloat16_dots and len(asked) == 1
    assert measured.machine_tuning(path=path, announce=quiet, bfloat16=True).bfloat16_dots and len(asked) == 1  # kept


def reference_mixture(x, w1, w3, w2, experts, mix):
    """Each row through its chosen experts, in float64: ``sum_j mix[b, j] * w2[e] @ (silu(w1[e] @ x[b]) * w3[e] @ x[b])``."""
    x, w1, w3, w2, mix = (t.double() for t in (x, w1, w3, w2, mix))
    rows = []
    for b in range(x.shape[0]):
        out = torch.zeros(w2.shape[1], dtype=torch.float64)
        for j, e in enumerate(experts[b].tolist()):
            out += mix[b, j] * (w2[e] @ (F.silu(w1[e] @ x[b]) * (w3[e] @ x[b])))
        rows.append(out)
    return torch.stack(rows)


def stacked_experts(n_experts: int, hidden: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(n_experts, hidden, dim, generator=g) * dim**-0.5 for _ in range(2))
    return w1, w3, torch.randn(n_experts, dim, hidden, generator=g) * hidden**-0.5


@needs_kernels
def test_the_mixture_docstring_example():
    """4 rows, top-2 of 8, ``experts = [[0, 3], [3, 5], [0, 1], [3, 7]]``: every row is its two experts
    mixed (expert 3 read once for rows 0, 1 and 3), within float32's rounding of float64."""
    w1, w3, w2 = stacked_experts(8, 23, 37)
    x = torch.randn(4, 37, generator=torch.Generator().manual_seed(1))
    experts = torch.tensor([[0, 3], [3, 5], [0, 1], [3, 7]])
    mix = torch.softmax(torch.randn(4, 2, generator=torch.Generator().manual_seed(2)), -1)
    got = torch.ops.mixtral_infer_dots.float_experts(x, w1, w3, w2, experts, mix)
    torch.testing.assert_close(got.double(), reference_mixture(x, w1, w3, w2, experts, mix), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11])
def test_the_mixture_is_each_row_s_chosen_experts_even_all_on_one_expert(rows):
    """Random routings, and every row on the same two experts (an expert's share at its largest: 8 rows
    at once, 11 in passes); D = 37 and I = 23: neither fills 8 lanes or a set of weight rows."""
    w1, w3, w2 = stacked_experts(4, 23, 37, seed=rows)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 37, generator=g)
    mix = torch.softmax(torch.randn(rows, 2, generator=g), -1)
    for experts in (torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(rows)]), torch.tensor([[2, 1]] * rows)):
        got = torch.ops.mixtral_infer_dots.float_experts(x, w1, w3, w2, experts, mix)
        torch.testing.assert_close(got.double(), reference_mixture(x, w1, w3, w2, experts, mix), atol=1e-5, rtol=1e-5)


@needs_kernels
def test_the_mixture_refuses_an_expert_it_does_not_hold_and_mismatched_stacks():
    w1, w3, w2 = stacked_experts(4, 24, 40)
    x, mix = torch.randn(2, 40), torch.full((2, 2), 0.5)
    with pytest.raises(RuntimeError, match=r"experts must be in \[0, 4\), got 4"):
        torch.ops.mixtral_infer_dots.float_experts(x, w1, w3, w2, torch.tensor([[0, 4], [1, 2]]), mix)
    with pytest.raises(RuntimeError, match="w2 must be a contiguous"):
        torch.ops.mixtral_infer_dots.float_experts(x, w1, w3, w2.transpose(1, 2).contiguous(), torch.tensor([[0, 1], [1, 2]]), mix)


@needs_kernels
def test_a_float32_mixtral_decodes_its_experts_through_the_operator_eager_and_compiled():
    """Under ``Tuning(float_dots=True)`` a float32 Mixtral's layers choose the operator; decoding
    (``Transformer.forward`` on rows of one token) gives the reference model's logits, and a compiled
    step calls the operator once a layer and gives the eager step's logits. A prompt chunk (more
    than 8 rows) keeps the grouping by expert."""
    reference = random_model(tiny_args(moe=True), seed=6)
    fast = use_formats(copy.deepcopy(reference), FLOAT_DOTS)
    assert all(layer.feed_forward.strategy.float_experts for layer in fast.layers.values())
    assert not any(layer.feed_forward.strategy.float_experts for layer in use_formats(copy.deepcopy(reference), Tuning()).layers.values())
    logits = []
    for model in (fast, reference):
        with torch.inference_mode():
            cache = model.make_cache(2)
            cache.start_sequences(2)
            prompt = model(torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(0)), [12, 8], cache)
            logits.append(torch.cat([prompt, model(torch.tensor([4, 9]), [1, 1], cache)]))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)

    expected, got, codes = eager_and_compiled_decode(fast, FLOAT_DOTS)
    calls = sum(code.count("torch.ops.mixtral_infer_dots.float_experts.default(") for code in codes)
    assert calls == len(fast.layers)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_a_mixtral_that_learns_keeps_its_gradients():
    """With gradients recorded for the experts or the router (the operator has no backward), the
    layer groups its experts as the reference does: the same output and the same gradients."""
    reference = random_model(tiny_args(moe=True), seed=7).layers["0"].feed_forward
    fast = use_formats(copy.deepcopy(random_model(tiny_args(moe=True), seed=7)), FLOAT_DOTS).layers["0"].feed_forward
    assert fast.strategy.float_experts
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for layer in (fast, reference):
        layer.zero_grad()
        layer(x).square().sum().backward()
    for name in ("w1", "w2", "w3", "gate.weight"):
        got, expected = fast.get_parameter(name).grad, reference.get_parameter(name).grad
        assert got is not None and torch.count_nonzero(got) > 0, name
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_a_saved_model_decodes_through_the_operator_in_a_new_process(tmp_path):
    """``torch.save`` of a float32 Mixtral under ``float_dots``, read in another process: the layers
    choose their strategy again there (which loads the library) and decode to the same logits."""
    import subprocess
    import sys

    model = use_formats(random_model(tiny_args(moe=True), seed=8), FLOAT_DOTS)
    tokens = torch.tensor([3, 7, 11])

    def decode(m):
        with torch.inference_mode():
            cache = m.make_cache(3)
            cache.start_sequences(3)
            return m(tokens, [1, 1, 1], cache)

    torch.save(model, tmp_path / "model.pt")
    script = (
        "import sys, torch\n"
        f"m = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        "assert all(l.feed_forward.strategy.float_experts for l in m.layers.values())\n"
        "with torch.inference_mode():\n"
        "    cache = m.make_cache(3); cache.start_sequences(3)\n"
        f"    torch.save(m(torch.tensor([3, 7, 11]), [1, 1, 1], cache), {str(tmp_path / 'logits.pt')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), decode(model), atol=1e-5, rtol=1e-5)
