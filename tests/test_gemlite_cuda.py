"""GemLite's CUDA products (``quant/gemlite_cuda.py``) as far as a CPU can check them: the weights
handed to GemLite stand, in its format ``(W_q - zeros) * scales``, for exactly the weight the
reference multiplies by; which weights it takes; which products ``linear`` sends to it;
that serving counts its layout. Its kernels themselves run in ``tests/test_cuda.py`` on a GPU."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import List, Optional

import pytest
import torch
from conftest import WINDOW, random_model, tiny_args

from mixtral_infer import generate
from mixtral_infer.formats.modules import use_formats
from mixtral_infer.kernels.linear import int4, linear, reference_linear
from mixtral_infer.steps.decode_loop import step_compiler
from mixtral_infer.kernels.linear import gemlite as gemlite_cuda
from mixtral_infer.formats.quantizing import quantize_model
from mixtral_infer.quant.weights import QuantizedParameter, QuantizedWeight, QuantScheme, quantize
from mixtral_infer.serve.sizing import weight_bytes
from mixtral_infer.tuning import Tuning


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
    assert int4.int4_layout(held[0]) == "cpu"


class StandIn:
    """A GemLite product's place, on CPU: what ``linear`` hands it is recorded, and the
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
        return reference_linear(x, self.weight)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_linear_hands_gemlite_fewer_than_its_rows_in_its_dtype(scheme):
    weight = quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(2)), QuantScheme.parse(scheme),
                      torch.bfloat16)  # fmt: skip
    weight.gemlite = StandIn(weight)
    for rows in (1, 4, gemlite_cuda.ROWS - 1):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        assert torch.equal(linear(x, weight), reference_linear(x, weight))
    assert weight.gemlite.calls == [(1, 96), (4, 96), (gemlite_cuda.ROWS - 1, 96)]
    linear(torch.randn(gemlite_cuda.ROWS, 96, dtype=torch.bfloat16), weight)  # a prompt chunk
    linear(torch.randn(1, 96), weight)  # float32 activations: the reference
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
            BF16 = FP16 = FP32 = None

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


CALLS: list = []  # rows of each chunk the stand-in op multiplied


def stand_in_op():
    """``gemlite::forward_functional`` as GemLite declares it (a custom op with a fake), on CPU,
    computing what its format stands for from ``tensors = (W_q, scales)`` and ``meta = (zeros,
    group_size)``: this machine has no GemLite (no CUDA), so the name is free."""
    if hasattr(torch.ops.gemlite, "forward_functional"):
        return

    @torch.library.custom_op("gemlite::forward_functional", mutates_args=())
    def forward_functional(x: torch.Tensor, bias: Optional[torch.Tensor], tensor_args: List[torch.Tensor],
                           meta_args: List[int], matmul_type: int = -1) -> torch.Tensor:  # fmt: skip
        CALLS.append(x.shape[0])
        W_q, scales = tensor_args
        zeros, group_size = meta_args
        return torch.nn.functional.linear(x, gemlite_cuda.dequantize(W_q, scales, zeros, group_size, x.dtype))

    @forward_functional.register_fake
    def _(x, bias, tensor_args, meta_args, matmul_type=-1):
        return x.new_empty(x.shape[0], tensor_args[0].shape[0])


def assert_alike(got, expected):
    """Same tokens, logprobs within 0.1 (bfloat16 products computed another way, as
    ``test_nf4``'s compiled step against eager)."""
    assert got[0] == expected[0]
    for row_got, row_expected in zip(got[1], expected[1]):
        assert row_got == pytest.approx(row_expected, abs=0.1)


@pytest.mark.parametrize("moe, scheme", [(False, "int8"), (True, "int4")], ids=["mistral-int8", "mixtral-int4"])
def test_decoding_through_gemlites_op_compiles_and_decodes_as_pytorchs_kernels(moe, scheme, monkeypatch):
    """A ``GemliteProduct`` on every weight GemLite takes (attention, dense feed-forward; not the
    stacked experts), calling GemLite's op (a CPU stand-in with its signature) through ours with a
    float32 output (``Tuning.gemlite_float32_outputs``, as ``product`` makes them): decoding compiled as
    on a GPU (``torch.compile``, ``fullgraph``: the products trace without a break) gives eager's
    tokens, the op multiplying every step's rows; the first tokens are those of PyTorch's kernels
    (later ones may part at a near tie: the products round differently). int4 weights keep their
    plain bytes, as on a GPU, instead of the CPU kernel's layout. Two of the four pairs: each is a
    compiled step (15 s), and either scheme's product is the same op call."""
    stand_in_op()
    from test_model import random_prompts  # noqa: PLC0415 (its fixtures stay out of this module)

    if scheme == "int4":
        monkeypatch.setattr("mixtral_infer.formats.quantizing.prepare_weight", lambda weight, *options: weight)
    plain = quantize_model(random_model(tiny_args(moe=moe, max_batch_size=2), seed=31).to(torch.bfloat16), scheme)
    with_gemlite = copy.deepcopy(plain)
    step_compiler(with_gemlite).tuning = Tuning(ahead_of_time=False)  # torch.compile, as on a GPU
    taken = []
    for name, module in with_gemlite.named_modules():
        if isinstance(module, QuantizedParameter) and gemlite_cuda.supports(module):
            W_q, scales, zeros, _, group_size = gemlite_cuda.arguments(module)
            module.gemlite = gemlite_cuda.GemliteProduct((W_q, scales), (zeros or 0, group_size), float32_out=True)
            taken.append(name)
    use_formats(with_gemlite)  # the weights GemLite packed: its back-end (kernels.linear's table)
    assert type(with_gemlite.layers["0"].attention.wq).__name__ == "GemliteLinear"
    assert ("layers.0.feed_forward.w1.weight" in taken) == (not moe) and "layers.0.attention.wq.weight" in taken
    assert not any("experts" in name or name.endswith("feed_forward.w1") for name in taken)
    # Prompts whose sampled tokens meet no near tie: the compiled step's products round otherwise than
    # eager's, and a tie parts them (seed 7's did once the MoE step's block became one region reused
    # for every layer: its kernels, and their roundings, changed).
    prompts = random_prompts([2 * WINDOW + 1, 3], plain.args.vocab_size, seed=0)
    settings = dict(max_tokens=2 * WINDOW, prompt_logprobs=False)
    CALLS.clear()
    eager = generate(prompts, with_gemlite, decode="eager", **settings)
    assert {1, 2} & set(CALLS)  # decoding's rows (one a sequence) went through it
    CALLS.clear()
    assert_alike(generate(prompts, with_gemlite, decode="compiled", **settings), eager)
    assert CALLS.count(2) >= 2 * WINDOW - 1  # the compiled step's 2 rows, every step
    first = tuple([row[:WINDOW] for row in rows] for rows in eager)
    pytorchs = generate(prompts, plain, decode="eager", max_tokens=WINDOW, prompt_logprobs=False)
    assert_alike(first, pytorchs)


@pytest.mark.parametrize("float32_out", [True, False], ids=["float32-outputs", "gemlite-s-outputs"])
def test_a_gemlite_product_gives_the_activations_dtype_either_way(float32_out):
    """Through ``mixtral_infer::gemlite_mm`` (float32 out, our conversion) or GemLite's op directly:
    the reference's product in the activations' dtype, the op's output float32 when traced too."""
    stand_in_op()
    weight = quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(4)), QuantScheme.parse("int4-32"),
                      torch.bfloat16)  # fmt: skip
    W_q, scales, zeros, _, group_size = gemlite_cuda.arguments(weight)
    product = gemlite_cuda.GemliteProduct((W_q, scales), (zeros, group_size), float32_out=float32_out)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    got = product(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, reference_linear(x, weight))
    traced = torch.compile(lambda v: torch.ops.mixtral_infer.gemlite_mm(v, [W_q, scales], [zeros, group_size]),
                           backend="eager", fullgraph=True)(x)  # fmt: skip
    assert traced.dtype == torch.float32 and torch.equal(traced.to(torch.bfloat16), got)


class FakeGemlite:
    """GemLite's packing API as ``product`` calls it, recording what each layer is asked for."""

    class DType:  # GemLite's are enum members; product hands them over as they are
        BF16, FP16, FP32 = 1, 2, 3

    class GemLiteLinear:
        def __init__(self, bits, group_size, in_features, out_features, input_dtype, output_dtype):
            self.output_dtype = output_dtype

        def pack(self, W_q, scales, zeros):
            self.W_q = W_q

        def get_tensor_args(self):
            return [self.W_q]

        def get_meta_args(self):
            return [self.output_dtype]

    class helper:
        class A16W8_INT8:
            def __init__(self, device, dtype):
                pass

            def from_weights(self, W_q, scales):
                layer = FakeGemlite.GemLiteLinear(8, None, None, None, None, FakeGemlite.DType.BF16)
                layer.pack(W_q, scales, None)
                return layer


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("float32", [True, False], ids=["float32-outputs", "gemlite-s-outputs"])
def test_product_asks_gemlite_for_float32_outputs_unless_told_not_to(scheme, float32, monkeypatch):
    """int4's layer is made with float32 outputs, int8's (GemLite's helper makes it in the weight's
    dtype) given them before its meta is read; without ``float32_outputs`` (``Tuning.gemlite_float32_outputs``
    off, the default), the weight's dtype."""
    monkeypatch.setattr(gemlite_cuda, "library", lambda: FakeGemlite)
    weight = quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(5)), QuantScheme.parse(scheme),
                      torch.bfloat16)  # fmt: skip
    product = gemlite_cuda.product(weight, float32_outputs=float32)
    assert gemlite_cuda.product(weight).float32_out is False and not Tuning().gemlite_float32_outputs
    assert product.float32_out == float32
    assert product.meta == (FakeGemlite.DType.FP32 if float32 else FakeGemlite.DType.BF16,)


def test_gemlites_tunings_are_kept_between_processes(tmp_path, monkeypatch):
    """What GemLite tuned is written when the process ends and loaded by the next one."""

    class Tunings:  # GemLite's load_config / cache_config, on a dict instead of its kernels
        def __init__(self, tuned):
            self.tuned = dict(tuned)

        def load_config(self, path, print_error=True):
            self.tuned.update(json.loads(Path(path).read_text()))

        def cache_config(self, path):
            kept = json.loads(Path(path).read_text()) if Path(path).exists() else {}
            Path(path).write_text(json.dumps({**kept, **self.tuned}))

    at_exit = []
    monkeypatch.setattr(gemlite_cuda.atexit, "register", at_exit.append)
    path = gemlite_cuda.tuning_file("NVIDIA H200", "0.6.0.post2")
    assert path.endswith("mixtral_infer_gemlite/nvidia_h200-0.6.0.post2.json")
    path = str(tmp_path / "kept" / "nvidia_h200-0.6.0.post2.json")
    first = Tunings({"GEMV_SPLITK (1, 4096, 4096)": "config a"})
    gemlite_cuda.keep_tuning(first, path)  # nothing kept yet
    at_exit.pop()()  # the first process ends
    second = Tunings({"GEMV_REVSPLITK (1, 1024, 4096)": "config b"})
    gemlite_cuda.keep_tuning(second, path)
    assert second.tuned == {"GEMV_SPLITK (1, 4096, 4096)": "config a", "GEMV_REVSPLITK (1, 1024, 4096)": "config b"}
    at_exit.pop()()
    assert json.loads(Path(path).read_text()) == second.tuned


def test_a_gemlite_that_cannot_be_set_up_is_left_unused(tmp_path, monkeypatch, caplog):
    """A GemLite without the switch that adds split sums in float32 (an API that moved) is not used
    half set up (its 4-bit products would be 2% off): one logged line, PyTorch's kernels."""
    monkeypatch.setattr(gemlite_cuda, "keep_tuning", lambda gemlite, path: None)

    class Old:
        __version__, __file__ = "0.1", str(tmp_path / "gemlite" / "__init__.py")

    with caplog.at_level("WARNING"):
        assert gemlite_cuda.configured(Old, "NVIDIA H200") is None
    assert caplog.messages == [
        "GemLite 0.1 could not be set up (AttributeError: type object 'Old' has no attribute "
        "'set_native_atomic_bfp16'); using PyTorch's kernels"
    ]

    class Current(Old):
        switched, loaded = [], []
        set_native_atomic_bfp16 = switched.append
        load_config = loaded.append

    (tmp_path / "gemlite" / "configs").mkdir(parents=True)
    (tmp_path / "gemlite" / "configs" / "h100.json").write_text("{}")
    assert gemlite_cuda.configured(Current, "NVIDIA H200") is Current
    assert Current.switched == [False] and Current.loaded == [str(tmp_path / "gemlite" / "configs" / "h100.json")]
    Current.loaded.clear()
    assert gemlite_cuda.configured(Current, "NVIDIA H100 80GB HBM3") is Current and Current.loaded == []
