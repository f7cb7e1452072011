"""int8 weights times int8 activations on CPU (``quantize="w8a8"``): fbgemm's dynamic int8 product.

PyTorch's weight-only int8 kernel (``aten._weight_int8pack_mm``) widens every weight to a
float before it multiplies, and on CPU that arithmetic, not memory, is its limit: it reads
int8 weights slower than oneDNN reads bfloat16 ones. llama.cpp's Q8_0
quantizes the activations to 8 bits too and multiplies integers (VNNI dot products into
32-bit sums). PyTorch's x86 quantized backend, fbgemm, has that product:
``quantized::linear_dynamic`` quantizes the activations to uint8 at run time and sums
``uint8 x int8`` in int32, faster than the weight-only kernel at every row count
(docs/performance.md, "w8a8: int8 activations through fbgemm").

**One scale per row.** fbgemm picks one activation range (min, max) for all rows of ``x``,
so a sequence's numbers would depend on the other sequences of its batch. This module first
divides each row by its largest magnitude, then appends a *range row* holding ``-128/127``
and ``1``: fbgemm's range is then ``[-128/127, 1]`` whatever the batch, its scale ``1/127``
and zero point 128, and each row is quantized on its own, symmetrically, as the int8 weights
are: ``q = round(127 * x / max|x|)`` in [-127, 127], times ``max|x| / 127`` afterwards.
llama.cpp's Q8_0 does the same per block of 32 inputs. A CPU without 32-bit-summing 8-bit
dot products (``hardware.cpu_info().int8_dot``: VNNI, AMX) would saturate fbgemm's 16-bit
pair sums, so there the rows get 63 levels (``reduce_range``, 7 bits).

Worked example, one row ``x = [0.5, -0.25]`` and int8 weight rows ``[2, -3]`` (scale 0.01)
and ``[1, 1]`` (scale 0.02): ``max|x| = 0.5``, ``q = round(127 * [1, -0.5]) = [127, -64]``
(-63.5 rounds to even), ``q . [2, -3] = 446``, ``q . [1, 1] = 63``; out = ``[446 * 0.01,
63 * 0.02] * 0.5 / 127 = [0.017559, 0.004961]`` (the float product gives ``[0.0175, 0.0050]``).

Every CPU product goes through fbgemm, prompts too: with many rows its integer product is
compute-bound, and faster than a float32 one, where int8's dequantizing would first unpack fbgemm's
matrices (docs/performance.md, section 6). The readable reference is ``reference_linear``.

Packed like ``fast.cpu_packed``'s bfloat16 weights, in a ``PackedWeight`` whose table entry
calls fbgemm: ``QuantizedWeight.prepacked`` holds it (the plain integers are dropped; ``dense()``
gives them back), so compiled code reaches it through the same op, and experts index alike.
"""

from __future__ import annotations

import contextlib
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mixtral_infer.fast.cpu_packed import PackedWeight, _Matrices, packed_linear, side_by_side, side_by_side_groups
from mixtral_infer.hardware import cpu_info
from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend
from mixtral_infer.kernels.linear.int8 import Int8Linear
from mixtral_infer.memory import release_freed_memory
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning


def available() -> bool:
    """Whether this PyTorch has fbgemm's dynamic int8 product (x86 builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


def levels() -> int:
    """The largest activation integer: 127, or 63 where 8-bit dot products saturate (module docstring)."""
    return 127 if cpu_info().int8_dot else 63


_RANGE_ROWS: Dict[tuple, torch.Tensor] = {}  # (in_features, levels) -> its range row, made when packing


def _range_row(in_features: int, levels: int) -> torch.Tensor:
    """``(1, IN)``: ``-(L+1)/L`` and ``1``, the rest 0: fbgemm's range becomes ``[-(L+1)/L, 1]``, so its
    scale is ``1/L`` and its zero point ``L + 1`` for every batch."""
    key = (in_features, levels)
    if key not in _RANGE_ROWS:
        row = torch.zeros(1, in_features)
        row[0, 0], row[0, 1] = -(levels + 1) / levels, 1.0
        _RANGE_ROWS[key] = row
    return _RANGE_ROWS[key]


def _fbgemm_multiply(x: torch.Tensor, matrix) -> torch.Tensor:
    """``x (M, IN)`` float32, rows already scaled to ``[-1, 1]`` and ending in the range row, 127 levels."""
    return torch.ops.quantized.linear_dynamic(x, matrix, False)


def _fbgemm_multiply_7_bits(x: torch.Tensor, matrix) -> torch.Tensor:
    """The same with 63 levels (``reduce_range``): 7-bit activations, whose pair sums cannot saturate."""
    return torch.ops.quantized.linear_dynamic(x, matrix, True)


def _fbgemm_integers(matrix) -> torch.Tensor:
    """The ``(OUT, IN)`` int8 weight an fbgemm matrix was packed from."""
    weight, _ = torch.ops.quantized.linear_unpack(matrix)
    return weight.int_repr()


@contextlib.contextmanager
def _packing():
    """Where fbgemm's matrices are made: its quantized engine, and quiet about the deprecated quantized
    tensors its packing takes. Both are process-wide settings: enter it from one thread only."""
    with warnings.catch_warnings():
        deprecated = "torch.quantize_per_tensor, torch.quantize_per_channel"  # the start of PyTorch's warning
        warnings.filterwarnings("ignore", message=deprecated, category=UserWarning)
        previous, torch.backends.quantized.engine = torch.backends.quantized.engine, "fbgemm"
        try:
            yield
        finally:
            torch.backends.quantized.engine = previous


def _fbgemm_matrix(values: torch.Tensor, scales: torch.Tensor):
    """fbgemm's packed matrix of int8 ``values (OUT, IN)`` with one float scale per row (inside ``_packing``)."""
    zero_points = torch.zeros(values.shape[0], dtype=torch.int64)
    weight = torch._make_per_channel_quantized_tensor(values.contiguous(), scales.to(torch.float64), zero_points, 0)
    return torch.ops.quantized.linear_prepack(weight, None)


def _packed(matrices: List, shape: torch.Size, levels: int) -> PackedWeight:
    """The packed weight; ``levels`` (127 or 63) is fixed here, once, for the products it will take part in."""
    multiply = _fbgemm_multiply if levels == 127 else _fbgemm_multiply_7_bits
    owner = _Matrices(matrices, shape[-2], multiply=multiply, plain=_fbgemm_integers)
    owner.levels = levels  # a constant to compiled code, as the handle is
    _range_row(shape[-1], levels)  # made now: compiled code only looks it up
    return PackedWeight(owner, shape, torch.int8)


def pack_weights(weights: List[QuantizedWeight]) -> None:
    """``_pack_weights`` (below), from one thread."""
    with _packing():
        _pack_weights(weights)


def _pack_weights(weights: List[QuantizedWeight]) -> None:
    """Pack w8a8 weights (``(OUT, IN)``, or stacked experts ``(E, OUT, IN)``) for fbgemm, in place:
    ``prepacked`` gets the matrices, and the plain integers are dropped (``dense()`` gives them back).

    Several weights that multiply the same input (``wq wk wv``, ``w1 w3``) become one matrix of their
    rows stacked, each weight a block of rows, as ``fast.cpu_packed`` packs bfloat16 ones:
    ``W8a8Linear.products`` multiplies them in one product: fbgemm's calls cost more
    for small matrices than their arithmetic (docs/performance.md, "w8a8: int8 activations through fbgemm")."""
    first = weights[0]
    shape = torch.Size((*first.shape[:-2], sum(w.shape[-2] for w in weights), first.shape[-1]))
    experts = [None] if len(shape) == 2 else range(shape[0])

    def joined(e) -> tuple:  # expert e's integers and scales (the only ones for None), rows stacked
        pick = (lambda t: t) if e is None else (lambda t: t[e])
        return torch.cat([pick(w.values) for w in weights]), torch.cat([pick(w.scales).float() for w in weights])

    whole = _packed([_fbgemm_matrix(*joined(e)) for e in experts], shape, levels())  # one expert copied at a time
    start = 0
    for weight in weights:
        stop = start + weight.shape[-2]
        weight.prepacked = whole if len(weights) == 1 else PackedWeight(whole.owner, weight.shape, torch.int8, rows=(start, stop))
        weight.values = None
        start = stop


class W8a8Linear(LinearBackend):
    """int8 weights packed for fbgemm at load (``QuantizedWeight.prepacked``), on CPU: every product,
    of any float dtype (fbgemm takes float32; bfloat16 converts) and any number of rows (prompts too:
    fbgemm's integer product is faster than float32's there) (module docstring)."""

    devices = ("cpu",)

    @classmethod
    def reads(cls, weight: object) -> bool:
        return isinstance(weight, QuantizedWeight) and weight.prepacked is not None

    @classmethod
    def prepare_model(cls, model: nn.Module, tuning: Tuning, pack: bool | str) -> None:
        pack_model(model)

    @staticmethod
    def product(x: torch.Tensor, weight: QuantizedWeight, tuning: Tuning = DEFAULT) -> torch.Tensor:
        if x.device.type != "cpu":  # a model moved off the CPU: fbgemm's matrices stay there, int8's kernels read them back
            return Int8Linear.product(x, weight, tuning)
        return int8_activations_linear(x, weight.prepacked)

    @classmethod
    def products(cls, x: torch.Tensor, weights: Sequence, tuning: Tuning = DEFAULT) -> List[torch.Tensor]:
        """Weights packed side by side (``pack_weights``): one product of the group, split."""
        whole = side_by_side([w.prepacked for w in weights])
        if whole is None or x.device.type != "cpu":
            return [cls.product(x, weight, tuning) for weight in weights]
        return list(int8_activations_linear(x, whole).split([w.shape[-2] for w in weights], dim=-1))


def pack_model(model: nn.Module) -> nn.Module:
    """Pack a model's w8a8 weights on CPU for fbgemm (``pack_weights``), in place: ``wq wk wv`` side
    by side, as are ``w1 w3`` (``fast.cpu_packed.SIDE_BY_SIDE``), the others one by one. Without
    fbgemm (a PyTorch not built for x86) they stay int8 weights, multiplied weight-only."""
    modules = dict(model.named_modules())

    def waiting(module) -> bool:
        return (
            isinstance(module, QuantizedWeight) and module.scheme.activations == "int8" and module.prepacked is None
            and module.values is not None and module.device.type == "cpu"
        )  # fmt: skip

    names = [name for name, module in modules.items() if waiting(module)] if available() else []
    groups = [[modules[n] for n in group] for group in side_by_side_groups(names, lambda name: modules[name].shape)]

    def pack_group(group: List[QuantizedWeight]) -> None:
        _pack_weights(group)
        release_freed_memory()  # the integers replaced

    # fbgemm packs on one core: a group per thread packs the groups on every core (docs/performance.md, section 13)
    with _packing(), ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        list(pool.map(pack_group, groups))
    return model


def int8_activations_linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``x (M, IN) @ weight.T`` -> ``(M, OUT)`` in ``x``'s dtype, each row quantized on its own (module docstring)."""
    rows = x.to(torch.float32)
    peak = rows.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)  # (M, 1)
    scaled = torch.cat([rows / peak, _range_row(x.shape[-1], weight.owner.levels)])  # (M + 1, IN), the last the range row
    return (packed_linear(scaled, weight)[:-1] * peak).to(x.dtype)


def reference_linear(x: torch.Tensor, integers: torch.Tensor, scales: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """The readable product: ``x (M, IN)`` quantized row by row to ``levels``, times int8 ``integers (OUT, IN)``
    with ``scales (OUT,)``. fbgemm's equals it to float32 rounding, except that an input within
    rounding of a tie (``127 x / max|x|`` = k + 1/2, frequent among bfloat16 inputs) may round the other way."""
    rows = x.to(torch.float32)
    peak = rows.abs().amax(dim=-1, keepdim=True)  # (M, 1)
    q = torch.round(rows / torch.where(peak > 0, peak, 1) * levels)  # (M, IN), integers in [-L, L]
    return (F.linear(q, integers.to(torch.float32) * scales.to(torch.float32)[:, None]) * peak / levels).to(x.dtype)
