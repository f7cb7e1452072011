"""w8a8: int8 weights times int8 activations through fbgemm (``quant.int8_activations``), against
its readable reference, row by row, and in models on every decode path."""

from __future__ import annotations

import pytest
import torch
from conftest import WINDOW, random_model, tiny_args
from test_model import random_prompts

from mixtral_infer import generate, load_model
from mixtral_infer.errors import ConfigError
from mixtral_infer.steps.decode_step import moe_one_token
from mixtral_infer.hardware import CpuInfo
from mixtral_infer.kernels.linear import w8a8 as int8_activations
from mixtral_infer.kernels.linear.w8a8 import int8_activations_linear, reference_linear
from mixtral_infer.kernels.linear.quantized_common import DEQUANTIZE_ROWS
from mixtral_infer.kernels.linear import linear, linears
from mixtral_infer.formats.quantizing import quantize_model
from mixtral_infer.quant.weights import QuantizedParameter, QuantizedWeight, QuantScheme, quantize
from mixtral_infer.serve.sizing import weight_bytes

W8A8 = QuantScheme.parse("w8a8")
LEVELS = int8_activations.levels()  # what weights packed on this CPU quantize activations to: 127, or 63 without VNNI
pytestmark = pytest.mark.skipif(not int8_activations.available(), reason="fbgemm (x86 PyTorch builds) is not in this PyTorch")


def packed(weight: QuantizedWeight) -> QuantizedWeight:
    int8_activations.pack_weights([weight])
    return weight


def w8a8_weight(shape, seed=0):
    return packed(quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), W8A8, torch.bfloat16))


def test_worked_example(monkeypatch):
    """The module docstring's: x = [0.5, -0.25], weight rows [2, -3] (scale 0.01) and [1, 1] (0.02), at
    127 levels (a CPU with 32-bit-summing dot products; this example's pair sums fit 16 bits on any)."""
    monkeypatch.setattr(int8_activations, "cpu_info", lambda: CpuInfo(int8_dot=True))
    integers, scales = torch.tensor([[2, -3], [1, 1]], dtype=torch.int8), torch.tensor([0.01, 0.02])
    expected = torch.tensor([[446 * 0.01, 63 * 0.02]]) * 0.5 / 127
    x = torch.tensor([[0.5, -0.25]])
    weight = packed(QuantizedWeight(W8A8, integers, scales, in_features=2))
    torch.testing.assert_close(int8_activations_linear(x, weight.prepacked), expected)
    torch.testing.assert_close(reference_linear(x, integers, scales), expected)


def test_scheme():
    assert W8A8 == QuantScheme("int8", activations="int8") and W8A8.label == "w8a8 (int8 activations)"
    assert W8A8.to_params() == {"scheme": "int8", "activations": "int8"}
    assert QuantScheme.parse(W8A8.to_params()) == W8A8  # as a folder's params.json records it
    with pytest.raises(ConfigError, match="only int8 weights take int8 activations"):
        QuantScheme.parse({"scheme": "int4", "group_size": 32, "activations": "int8"})
    with pytest.raises(ConfigError, match="expected one of int8, w8a8, int4"):
        QuantScheme.parse("w4a4")


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
def test_kernel_equals_the_reference_for_every_expert(rows):
    """Stacked experts, each picked by an int and by a tensor (compiled code's routing): fbgemm's
    product equals quantizing each row and multiplying the integers, to float32 rounding."""
    stacked = w8a8_weight((3, 96, 256), seed=rows)  # (E, OUT, IN)
    assert stacked.values is None and stacked.prepacked is not None  # fbgemm holds the integers
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(100 + rows))
    for e in range(3):
        expected = reference_linear(x, stacked.integers()[e], stacked.scales[e], LEVELS)
        for expert in (stacked[e], stacked[torch.tensor(e)]):
            torch.testing.assert_close(int8_activations_linear(x, expert.prepacked), expected, atol=1e-5, rtol=1e-5)
            bfloat16 = linear(x.bfloat16(), expert)
            # bfloat16 inputs: the float32 product of the same inputs, rounded (the reference may round a tie otherwise)
            float32 = int8_activations_linear(x.bfloat16().float(), expert.prepacked)
            torch.testing.assert_close(bfloat16.float(), float32, rtol=2**-8, atol=1e-5)


def test_the_integers_are_int8s():
    """fbgemm's matrices give back the integers quantize() chose for int8, and the same dequantized weight."""
    w = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    w8a8, int8 = packed(quantize(w, W8A8, torch.bfloat16)), quantize(w, QuantScheme.parse("int8"), torch.bfloat16)
    assert torch.equal(w8a8.integers(), int8.values) and torch.equal(w8a8[1].integers(), int8.values[1])
    assert torch.equal(w8a8.dequantize(), int8.dequantize()) and torch.equal(w8a8[torch.tensor(1)].dequantize(), int8.dequantize()[1])


def test_each_row_is_quantized_on_its_own():
    """Rows of very different sizes in one batch: each row's result is what it gives alone, bit for bit
    (fbgemm's one range per call is pinned by the range row), and as exact as the reference's."""
    weight = w8a8_weight((64, 128), seed=2)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3)) * torch.tensor([[1e3], [1.0], [1e-3], [0.0]])
    together = int8_activations_linear(x, weight.prepacked)
    for i in range(4):
        assert torch.equal(together[i : i + 1], int8_activations_linear(x[i : i + 1], weight.prepacked))
    assert torch.equal(together[3], torch.zeros(64))
    torch.testing.assert_close(together, reference_linear(x, weight.integers(), weight.scales, LEVELS), atol=0, rtol=1e-5)


def test_seven_bit_rows_where_8_bit_dot_products_saturate(monkeypatch):
    """Without VNNI/AMX (``int8_dot``) fbgemm's pair sums would saturate: 63 levels, and the reference agrees."""
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(int8_activations, "cpu_info", lambda: CpuInfo(int8_dot=True))
    eight_bits = w8a8_weight((64, 128), seed=4)
    monkeypatch.setattr(int8_activations, "cpu_info", lambda: CpuInfo(int8_dot=False))
    assert int8_activations.levels() == 63
    seven_bits = w8a8_weight((64, 128), seed=4)
    got = int8_activations_linear(x, seven_bits.prepacked)
    torch.testing.assert_close(got, reference_linear(x, seven_bits.integers(), seven_bits.scales, 63), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, int8_activations_linear(x, eight_bits.prepacked), atol=1e-5, rtol=1e-5)  # 127 levels differ


def test_prompt_sized_products_quantize_their_activations_too():
    """Unlike int8, which dequantizes from DEQUANTIZE_ROWS rows on, w8a8 multiplies prompts through fbgemm."""
    weight = w8a8_weight((32, 64), seed=6)
    x = torch.randn(DEQUANTIZE_ROWS, 64, generator=torch.Generator().manual_seed(7))
    expected = reference_linear(x, weight.integers(), weight.scales, LEVELS)
    torch.testing.assert_close(linear(x, weight), expected, atol=1e-5, rtol=1e-5)
    bfloat16 = x.bfloat16()  # the same product, its result rounded to bfloat16
    float32 = int8_activations_linear(bfloat16.float(), weight.prepacked)
    torch.testing.assert_close(linear(bfloat16, weight).float(), float32, rtol=2**-8, atol=1e-5)


def test_a_w8a8_model_holds_its_integers_in_fbgemm_and_counts_them():
    model = quantize_model(random_model(tiny_args(moe=True)).to(torch.bfloat16), "w8a8")
    int8 = quantize_model(random_model(tiny_args(moe=True)).to(torch.bfloat16), "int8")
    weights = [m for m in model.modules() if isinstance(m, QuantizedParameter)]
    assert weights and all(w.prepacked is not None and w.values is None for w in weights)
    assert weight_bytes(model) == weight_bytes(int8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("moe", [False, True], ids=["mistral", "mixtral"])
def test_static_and_compiled_decode_equal_eager(moe, dtype):
    """Batch 1 and 3, past the window: the static step (and at batch 3 the compiled one: fbgemm through
    the packed weights' op, experts picked in place) choose eager decoding's tokens. Compiled bfloat16 is left
    out: its fused arithmetic rounds a few inputs one bfloat16 step otherwise, and bfloat16 steps are
    as coarse as the int8 ones near a row's peak, so some activations round to the next integer,
    which flips near-ties of the logits (as quantizing does): measured, tiny-mistral's top two logits
    5.156 and 5.125 after 11 tokens. float32 moves none."""
    model = quantize_model(random_model(tiny_args(moe=moe, max_batch_size=3), seed=5).to(dtype), "w8a8")
    for lengths in ([2 * WINDOW + 1], [2 * WINDOW + 1, 3, 6]):
        prompts = random_prompts(lengths, 128, seed=len(lengths))
        eager_tokens, eager_logprobs = generate(prompts, model, max_tokens=2 * WINDOW, decode="eager")
        compiled = dtype == torch.float32 and len(lengths) == 3  # one compilation (a shape) per model: the suite's time
        for mode in ("static", "compiled") if compiled else ("static",):
            tokens, logprobs = generate(prompts, model, max_tokens=2 * WINDOW, decode=mode)
            assert tokens == eager_tokens, mode
            for got, expected in zip(logprobs, eager_logprobs):
                assert got == pytest.approx(expected, abs=1e-4 if dtype == torch.float32 else 0.1)


def test_the_one_token_moe_step_equals_the_grouped_layer():
    layer = quantize_model(random_model(tiny_args(moe=True), seed=25).to(torch.bfloat16), "w8a8").layers["0"].feed_forward
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(moe_one_token(layer, x), layer(x))


def test_weights_packed_side_by_side_multiply_as_one_by_one():
    """wq wk wv of a layer (and w1 w3 of each expert) share one fbgemm matrix, each a block of rows:
    their product, split, equals each weight packed alone, bit for bit, and each block alone too."""
    model = quantize_model(random_model(tiny_args(moe=True), seed=8).to(torch.bfloat16), "w8a8")
    attention, experts = model.layers["0"].attention, model.layers["0"].feed_forward
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    for group in ([attention.wq.weight, attention.wk.weight, attention.wv.weight], [experts.w1[1], experts.w3[1]]):
        assert len({w.prepacked.handle for w in group}) == 1 and all(w.prepacked.rows is not None for w in group)
        alone = [packed(QuantizedWeight(W8A8, w.integers(), w.scales, w.in_features)) for w in group]
        together = linears(x, *group)
        for w, a, out in zip(group, alone, together):
            assert torch.equal(out, linear(x, a)) and torch.equal(linear(x, w), out)
    assert experts.w2.prepacked.rows is None and model.output.weight.prepacked.rows is None  # alone


def test_a_served_w8a8_model_gives_each_request_its_solo_tokens():
    """The serving engine batches requests into shared products (8 requests on 3 rows, prompts read
    beside decoding rows); each row's activations are quantized on their own, so each request still
    gets what generate() gives it alone (float32 through fbgemm; the compiled step is tested above)."""
    from test_serve_engine import Recorder, mixed_requests, run, solo

    from mixtral_infer.serve.engine import Engine
    from mixtral_infer.tokenizer import Tokenizer

    model = load_model("tiny-mixtral", dtype=torch.float32, quantize="w8a8")
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    assert model.layers["0"].feed_forward.w1.prepacked is not None
    engine, recorder = Engine(model, tokenizer, rows=3, prefill_tokens=7, decode="static"), Recorder()
    requests = mixed_requests(tokenizer)
    for i, (prompt, settings) in enumerate(requests):
        engine.submit(prompt, settings, recorder.sink(i))
    run(engine)
    for i, (prompt, settings) in enumerate(requests):
        assert recorder.tokens(i) == solo(model, tokenizer, prompt, settings)[0], i
