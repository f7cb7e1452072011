"""int8 weights times int8 activations on CPU (``quantize="w8a8"``): fbgemm's dynamic int8 product.

PyTorch's weight-only int8 kernel (``aten._weight_int8pack_mm``) widens every weight to a
float before it multiplies, and on CPU that arithmetic, not memory, is its limit: it reads
9-13 GB/s of int8 weights where oneDNN reads bfloat16 ones at 20. llama.cpp's Q8_0
quantizes the activations to 8 bits too and multiplies integers (VNNI dot products into
32-bit sums). PyTorch's x86 quantized backend, fbgemm, has that product:
``quantized::linear_dynamic`` quantizes the activations to uint8 at run time and sums
``uint8 x int8`` in int32. Measured with torch 2.13.0 on the 2-core Xeon (avx512_vnni),
24 weights of 3584 x 1024 in turn (none stays in cache), ms per product:

==========================  =======  =======  =======  =======  =======
rows                         1        2        4        8        64
==========================  =======  =======  =======  =======  =======
``_weight_int8pack_mm``      0.30     0.35     0.38     0.73     (5.6)
fbgemm (this module)         0.10     0.10     0.11     0.16     0.65
==========================  =======  =======  =======  =======  =======

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

Products of ``DEQUANTIZE_ROWS`` rows or more (prompts) multiply weight-only, as int8 does
(dequantized weights, float activations). The readable reference is ``reference_linear``.

Packed like ``fast.cpu_packed``'s bfloat16 weights, in a ``PackedWeight`` whose table entry
calls fbgemm: ``QuantizedWeight.prepacked`` holds it (the plain integers are dropped; ``dense()``
gives them back), so compiled code reaches it through the same op, and experts index alike.
"""

from __future__ import annotations

import warnings
from typing import Dict, List

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_packed import PackedWeight, _Matrices, packed_linear
from mixtral_infer.hardware import cpu_info


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


def _fbgemm_matrix(values: torch.Tensor, scales: torch.Tensor):
    """fbgemm's packed matrix of int8 ``values (OUT, IN)`` with one float scale per row."""
    with warnings.catch_warnings():  # quantized tensors are deprecated in PyTorch; fbgemm's packing takes one
        warnings.simplefilter("ignore")
        weight = torch._make_per_channel_quantized_tensor(
            values.contiguous(), scales.to(torch.float64), torch.zeros(values.shape[0], dtype=torch.int64), 0
        )
        previous, torch.backends.quantized.engine = torch.backends.quantized.engine, "fbgemm"
        try:
            return torch.ops.quantized.linear_prepack(weight, None)
        finally:
            torch.backends.quantized.engine = previous


def pack(values: torch.Tensor, scales: torch.Tensor) -> PackedWeight:
    """int8 ``values (OUT, IN)`` or stacked experts ``(E, OUT, IN)`` with ``scales (..., OUT)``, packed for fbgemm."""
    matrices = [_fbgemm_matrix(v, s) for v, s in zip(values.view(-1, *values.shape[-2:]), scales.view(-1, scales.shape[-1]))]
    return _packed(matrices, values.shape, levels())


def _packed(matrices: List, shape: torch.Size, levels: int) -> PackedWeight:
    """The packed weight; ``levels`` (127 or 63) is fixed here, once, for the products it will take part in."""
    multiply = _fbgemm_multiply if levels == 127 else _fbgemm_multiply_7_bits
    owner = _Matrices(matrices, shape[-2], multiply=multiply, plain=_fbgemm_integers)
    owner.levels = levels  # a constant to compiled code, as the handle is
    _range_row(shape[-1], levels)  # made now: compiled code only looks it up
    return PackedWeight(owner, shape, torch.int8)


def stack(weights: List[PackedWeight]) -> PackedWeight:
    """Experts packed one by one, as one stacked weight ``(E, OUT, IN)``."""
    shape = torch.Size((len(weights), *weights[0].shape))
    return _packed([w.matrices[0] for w in weights], shape, weights[0].owner.levels)


def int8_activations_linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``x (M, IN) @ weight.T`` -> ``(M, OUT)`` in ``x``'s dtype, each row quantized on its own (module docstring)."""
    rows = x.to(torch.float32)
    peak = rows.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)  # (M, 1)
    scaled = torch.cat([rows / peak, _range_row(x.shape[-1], weight.owner.levels)])  # (M + 1, IN), the last the range row
    return (packed_linear(scaled, weight)[:-1] * peak).to(x.dtype)


def reference_linear(x: torch.Tensor, integers: torch.Tensor, scales: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """The readable product: ``x (M, IN)`` quantized row by row to ``levels``, times int8 ``integers (OUT, IN)``
    with ``scales (OUT,)``."""
    rows = x.to(torch.float32)
    peak = rows.abs().amax(dim=-1, keepdim=True)  # (M, 1)
    q = torch.round(rows / torch.where(peak > 0, peak, 1) * levels)  # (M, IN), integers in [-L, L]
    return (F.linear(q, integers.to(torch.float32) * scales.to(torch.float32)[:, None]) * peak / levels).to(x.dtype)
