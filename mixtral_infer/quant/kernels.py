"""The matrix products of quantized weights: PyTorch's weight-only kernels, chosen per device.

* **CPU int8**: ``torch.ops.aten._weight_int8pack_mm`` (reads the int8 weight at the speed
  ``F.linear`` reads bfloat16, so in half the time). torchao's ``Int8WeightOnlyConfig`` runs a
  dequantize-then-matmul on CPU, far slower.
* **CPU int4**: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the layout made by
  ``_convert_weight_to_int4pack_for_cpu`` (torchao has no CPU int4 layout of its own any more).
* **CPU nf4** (``quant/nf4.py``): bitsandbytes' AVX512-BF16 kernel (``nf4.kernel()``), through the
  op ``mixtral_infer::nf4_mm``, for fewer than ``NF4_DEQUANTIZE_ROWS`` rows; more rows dequantize
  (``dequantize_nf4_kernel_layout``, the reference's numbers); no kernel on this CPU: the reference.
* **CUDA nf4** (``quant/nf4.py``): bitsandbytes' fused CUDA kernel (``nf4.cuda_kernel()``,
  ``cgemm_4bit_bf16``), through the op ``mixtral_infer::nf4_cuda_mm``, for fewer than
  ``CUDA_NF4_KERNEL_ROWS`` rows; more rows, or no library for this CUDA: the reference.
* **CPU int8 with many rows** (prefill chunks of at least ``DEQUANTIZE_ROWS``): the int8 kernel is
  compute-bound there, and dequantizing (``dequantize_int8``) then multiplying with ``F.linear`` is
  faster. int4, where ``Tuning.upcast`` multiplies in float32 (``fast.cpu_upcast``), reads its
  kernel layout back (``dequantize_int4_kernel_layout``: its plain values are dropped) from
  ``INT4_DEQUANTIZE_ROWS`` rows on; where 16-bit products are the faster, it reads the layout back
  into bfloat16, as ``reference_linear`` does, from ``DEQUANTIZE_ROWS`` rows on.
* **CPU int8 in compiled code, 1-8 rows** (decoding): multiply-and-sum reductions that inductor
  writes (``fast.cpu_reductions``), faster than the int8 kernel. Integers with long rows, loaded
  with ``pack="columns"``, are kept only as column blocks (``fast.cpu_column_blocks``;
  ``packed = (blocks, scales)``), which the reductions read; compiled code with more rows runs the
  int8 kernel block by block (``int8_blocks_linear``), and op by op the kernel gets them put back
  together (``integers()``).
* Both CPU kernels are vectorised for bfloat16 activations only (float32 is many times slower),
  so float32 and float16 activations take the reference path: dequantize, then ``F.linear``.
* **CUDA int8**: as gpt-fast does it, ``F.linear(x, q.to(x.dtype)) * scales`` (compiled, the
  conversion fuses into the product).
* **CUDA int8 and int4 with GemLite installed** (``quant/gemlite_cuda.py``): GemLite's Triton
  matrix-vector and split-K kernels, for chunks of fewer than ``gemlite_cuda.ROWS`` rows of dense
  weights (not stacked experts); more rows take the paths below.
* **CUDA int4**: tinygemm, ``torch.ops.aten._weight_int4pack_mm`` on the layout made by
  ``_convert_weight_to_int4pack`` (gpt-fast's and torchao's int4 kernel), for bfloat16 chunks of
  fewer than ``CUDA_INT4_DEQUANTIZE_ROWS`` rows. It is made for few rows: for many, dequantizing and
  a bfloat16 product cost a fraction of it; so a CUDA int4 weight keeps its plain values beside the
  kernel layout (1 byte per weight in all, as int8) and prompt chunks dequantize. The CUDA ops
  exist only there: the CPU tests check the layout handed to them (``tinygemm_layout``), a CUDA
  test the product itself.

* **CUDA int8 and int4 with ``Tuning.triton_dense``**: our Triton kernels (``fast.triton_experts``,
  the weight read as one expert, dequantized where it is read) for up to ``TRITON_DENSE_ROWS`` rows,
  ahead of GemLite and the paths above; off until measured on a GPU.

``CUDA_INT4_DEQUANTIZE_ROWS`` and ``CUDA_NF4_KERNEL_ROWS`` follow the libraries' own dispatch.
``quantized_linear`` and ``quantized_linears`` take the ``Tuning`` to follow (``formats.modules``'
modules pass their own).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F

from mixtral_infer.fast import triton_experts
from mixtral_infer.fast.cpu_column_blocks import int8_blocks
from mixtral_infer.fast.cpu_packed import side_by_side
from mixtral_infer.fast.cpu_reductions import reduces, rows_as_reductions
from mixtral_infer.fast.cpu_upcast import should_upcast, upcast_linear
from mixtral_infer.quant import gemlite_cuda, nf4
from mixtral_infer.quant.int8_activations import int8_activations_linear
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning

DEFAULT = Tuning()  # what a call that is given no tuning follows


def reference_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x (M, IN) @ dequantize(weight).T`` -> ``(M, OUT)``: the readable path the kernels must equal."""
    return F.linear(x, weight.dequantize(x.dtype))


def uses_cpu_kernel(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.scales.dtype == torch.bfloat16


def uses_cuda_nf4_kernel(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """(Whether the library loads is not asked here, where compiled code is traced: weights get the
    CUDA layout only where it loaded, and the op falls back to the reference where it does not.)"""
    return x.device.type == "cuda" and x.dtype == weight.dtype == torch.bfloat16 and x.shape[0] < CUDA_NF4_KERNEL_ROWS


def uses_int8_activations(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """w8a8 packed for fbgemm (``quant.int8_activations``), and a CPU product: every one, of any
    float dtype (fbgemm takes float32; bfloat16 converts) and any number of rows (prompts too:
    fbgemm's integer product is faster than float32's there)."""
    return weight.prepacked is not None and x.device.type == "cpu"


def nf4_layout(weight: QuantizedWeight) -> Optional[str]:
    """Which of bitsandbytes' layouts an nf4 ``weight.packed`` holds (``nf4.held_layout``), or None."""
    return None if weight.packed is None else nf4.held_layout(weight.packed)


def int4_layout(weight: QuantizedWeight) -> Optional[str]:
    """Which kernel's layout ``weight.packed`` holds: ``"cpu"`` (bytes, as the plain values),
    ``"cuda"`` (tinygemm's int32 tiles) or None. A model moved between devices keeps its layout,
    which the other device's kernel must not read."""
    if weight.packed is None:
        return None
    return "cuda" if weight.packed[0].dtype == torch.int32 else "cpu"


DEQUANTIZE_ROWS = 512  # CPU int8: from this many rows on, dequantize + F.linear is faster (module docstring)
NF4_DEQUANTIZE_ROWS = 1024  # CPU nf4: from this many rows on, dequantize_nf4_kernel_layout + F.linear
# CUDA nf4: below this many rows, bitsandbytes' fused kernel; from it on, dequantize + F.linear.
# bitsandbytes' own dispatch on Hopper keeps its kernel for up to 4 rows always and for 5-7 on most
# shapes, and hands larger weights from 8 rows on to dequantize + F.linear on many shapes.
CUDA_NF4_KERNEL_ROWS = 8
INT4_DEQUANTIZE_ROWS = 1024  # CPU int4, where float32 multiplies faster: reading the layout back costs more


# One expert of stacked weights, the expert a 0-d tensor (compiled code's routing): these ops
# read it and call the CPU kernel on that expert's views, where a gather would copy the expert's
# weights first (2 experts x 3 matrices per layer per token). Declared with torch.library.Library,
# as fast.cpu_packed's op: the dispatcher calls the function directly.
_LIBRARY = torch.library.Library("mixtral_infer", "FRAGMENT")
_LIBRARY.define("int8_expert_mm(Tensor x, Tensor values, Tensor scales, Tensor expert) -> Tensor")
_LIBRARY.define("int4_expert_mm(Tensor x, Tensor packed, int group_size, Tensor scales_and_zeros, Tensor expert) -> Tensor")


def _int8_expert_mm(x, values, scales, expert):
    e = int(expert)
    return torch.ops.aten._weight_int8pack_mm(x, values[e], scales[e])


def _int4_expert_mm(x, packed, group_size, scales_and_zeros, expert):
    e = int(expert)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed[e], group_size, scales_and_zeros[e])


_LIBRARY.impl("int8_expert_mm", _int8_expert_mm, "CPU")
_LIBRARY.impl("int4_expert_mm", _int4_expert_mm, "CPU")


@torch.library.register_fake("mixtral_infer::int8_expert_mm")
def _(x, values, scales, expert):
    return x.new_empty(x.shape[0], values.shape[1])


@torch.library.register_fake("mixtral_infer::int4_expert_mm")
def _(x, packed, group_size, scales_and_zeros, expert):
    return x.new_empty(x.shape[0], packed.shape[1])


def expert_kernel_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor | None:
    """The CPU kernel on expert ``weight.expert`` of stacked weights, for few rows; None where
    the kernel would not be used (the caller then multiplies by ``weight.resolved()``)."""
    if not uses_cpu_kernel(x, weight) or x.shape[0] >= DEQUANTIZE_ROWS:
        return None
    x = x.contiguous()
    if weight.scheme.name == "int8" and weight.values is not None:
        return torch.ops.mixtral_infer.int8_expert_mm(x, weight.values, weight.scales, weight.expert)
    if weight.scheme.name == "int4" and int4_layout(weight) == "cpu":
        packed, scales_and_zeros = weight.packed
        return torch.ops.mixtral_infer.int4_expert_mm(x, packed, weight.scheme.group_size, scales_and_zeros, weight.expert)
    if weight.scheme.name == "nf4" and nf4_layout(weight) == "cpu":
        return torch.ops.mixtral_infer.nf4_expert_mm(x, *weight.packed, weight.scheme.group_size, weight.expert)
    return None


def int8_blocks_linear(x: torch.Tensor, weight: QuantizedWeight, streams: int = DEFAULT.streams) -> torch.Tensor:
    """Compiled code's ``x (M, IN) @ weight.T`` for int8 integers held in column blocks
    (``fast.cpu_column_blocks``), without putting them back together (a copy on every step): a few
    rows as reductions over the blocks (read in ``streams`` places), more rows block by block through
    the int8 kernel, each block's product rounded to ``x``'s dtype before the sum."""
    weight = weight.resolved()  # one expert of stacked weights (compiled code gives an expert one row: read in place)
    blocks = int8_blocks(weight)  # (n, OUT, B)
    if reduces(x, blocks):
        return rows_as_reductions(x, blocks, weight.scales, streams)
    if not uses_cpu_kernel(x, weight):
        return reference_linear(x, weight)
    parts = x.reshape(x.shape[0], blocks.shape[0], -1).unbind(1)  # n x (M, B)
    int8pack_mm = torch.ops.aten._weight_int8pack_mm
    products = [int8pack_mm(part.contiguous(), block, weight.scales) for part, block in zip(parts, blocks.unbind(0))]
    return torch.stack(products).sum(0)  # (n, M, OUT) -> (M, OUT)


def quantized_linears(
    x: torch.Tensor, weights: Sequence[QuantizedWeight], tuning: Tuning = DEFAULT
) -> List[torch.Tensor]:
    """``[quantized_linear(x, w, tuning) for w in weights]``, in one product where they are w8a8
    weights packed side by side (``int8_activations.pack_weights``) and the product quantizes
    activations."""
    joined = joined_linear(x, weights)
    if joined is not None:
        return joined
    whole = side_by_side([w.prepacked for w in weights])
    if whole is None or not uses_int8_activations(x, weights[0]):
        return [quantized_linear(x, w, tuning) for w in weights]
    return list(int8_activations_linear(x, whole).split([w.shape[-2] for w in weights], dim=-1))


def joined_linear(x: torch.Tensor, weights: Sequence[QuantizedWeight]) -> Optional[List[torch.Tensor]]:
    """``[quantized_linear(x, w) for w in weights]`` in one call of the nf4 kernel, where ``weights``
    are a whole group joined side by side (``quant.model.join_side_by_side``), in order, of one
    expert; else None."""
    first = weights[0]
    if first.joined is None or not uses_cpu_kernel(x, first) or x.shape[0] >= NF4_DEQUANTIZE_ROWS:
        return None
    rows = [w.joined_rows for w in weights]
    if any(r is None for r in rows):
        return None
    ends = [0] + [stop for _, stop, _ in rows]
    if [start for start, _, _ in rows] != ends[:-1] or ends[-1] != rows[0][2]:
        return None
    if not all(w.expert is first.expert for w in weights):
        return None
    values, scales = first.joined
    group_size, x = first.scheme.group_size, x.contiguous()
    if first.expert is None:
        out = torch.ops.mixtral_infer.nf4_mm(x, values, scales, group_size)
    else:
        out = torch.ops.mixtral_infer.nf4_expert_mm(x, values, scales, group_size, first.expert)
    return list(out.split([w.shape[-2] for w in weights], dim=-1))


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, tuning: Tuning = DEFAULT) -> torch.Tensor:
    """``x (M, IN) @ weight.T`` -> ``(M, OUT)`` through the device's kernel (module docstring), as
    ``tuning`` says (reductions' places, widening prompts to float32)."""
    if tuning.triton_dense and (kind := triton_dense_kind(x, weight)) is not None:
        return triton_experts.dense_rows(x, weight.values, weight.scales, kind)
    if gemlite_cuda.usable(x, weight):
        return weight.gemlite(x)
    if uses_int8_activations(x, weight):
        return int8_activations_linear(x, weight.prepacked)
    if weight.scheme.name == "int8" and weight.values is not None and reduces(x, weight.values):
        weight = weight.resolved()  # one expert of stacked weights: compiled code reads it in place
        return rows_as_reductions(x, weight.values, weight.scales, tuning.streams)  # compiled CPU decoding
    if int8_blocks(weight) is not None and torch.compiler.is_compiling():
        return int8_blocks_linear(x, weight, tuning.streams)
    if weight.expert is not None:
        out = expert_kernel_linear(x, weight)
        if out is not None:
            return out
        weight = weight.resolved()
    if weight.scheme.name == "nf4":
        layout = nf4_layout(weight)
        if layout == "cuda" and uses_cuda_nf4_kernel(x, weight):
            return torch.ops.mixtral_infer.nf4_cuda_mm(x.contiguous(), *weight.packed, weight.scheme.group_size)
        if layout == "cpu" and uses_cpu_kernel(x, weight):
            if x.shape[0] < NF4_DEQUANTIZE_ROWS:
                return torch.ops.mixtral_infer.nf4_mm(x.contiguous(), *weight.packed, weight.scheme.group_size)
            if weight.packed[0].dim() == 2:  # prompts: reference_linear's numbers, dequantized faster
                return F.linear(x, dequantize_nf4_kernel_layout(weight, x.dtype))
        return reference_linear(x, weight)
    if uses_cpu_kernel(x, weight):
        x = x.contiguous()
        upcast = should_upcast(x, tuning.upcast)  # this CPU multiplies float32 faster (fast.cpu_upcast)
        if weight.scheme.name == "int8" and x.shape[0] >= DEQUANTIZE_ROWS:
            if upcast:
                return upcast_linear(x, dequantize_int8(weight, torch.float32), tuning.onednn_float32)
            return F.linear(x, dequantize_int8(weight, x.dtype))  # reference_linear, bit for bit
        if weight.scheme.name == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, weight.integers(), weight.scales)
        cpu_layout = int4_layout(weight) == "cpu"
        readable = cpu_layout and weight.shape[-2] % INT4_BLOCK == 0 and int4_cpu_layout_reads_back()
        if readable and x.shape[0] >= DEQUANTIZE_ROWS:
            if not upcast:  # this CPU multiplies 16-bit faster: as reference_linear does
                return F.linear(x, dequantize_int4_kernel_layout(weight, x.dtype))
            if x.shape[0] >= INT4_DEQUANTIZE_ROWS:
                return upcast_linear(x, dequantize_int4_kernel_layout(weight), tuning.onednn_float32)
        if cpu_layout:
            packed, scales_and_zeros = weight.packed
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, weight.scheme.group_size, scales_and_zeros)
    elif x.device.type == "cuda" and weight.scheme.name == "int8" and weight.values is not None:
        return F.linear(x, weight.values.to(x.dtype)) * weight.scales.to(x.dtype)
    elif x.device.type == "cuda" and int4_layout(weight) == "cuda" and x.dtype == weight.dtype and x.shape[0] < CUDA_INT4_DEQUANTIZE_ROWS:
        packed, scales_and_zeros = weight.packed
        return torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, weight.scheme.group_size, scales_and_zeros)
    return reference_linear(x, weight)


TRITON_DENSE_ROWS = 64  # ``Tuning.triton_dense``: products of more rows (prompts) take the paths above


def triton_weight_kind(weight: QuantizedWeight) -> Optional[int]:
    """The kind ``fast.triton_experts`` reads ``weight`` as (``INT8``, ``INT4``), or None where its
    kernels do not take it: nf4, int8 with int8 activations, without its plain values, or one expert of
    stacked weights (``weight.expert``)."""
    if weight.scheme.activations is not None or weight.values is None or weight.expert is not None:
        return None
    return {"int8": triton_experts.INT8, "int4": triton_experts.INT4}.get(weight.scheme.name)


def triton_dense_kind(x: torch.Tensor, weight: QuantizedWeight) -> Optional[int]:
    """The kind ``fast.triton_experts.dense_rows`` reads ``weight`` as (``triton_weight_kind``), or None
    where it does not take it: stacked weights, more than ``TRITON_DENSE_ROWS`` rows, other
    activations than the scales' dtype, no kernels here."""
    if x.dim() != 2 or x.shape[0] > TRITON_DENSE_ROWS or x.dtype != weight.dtype or len(weight.shape) != 2:
        return None
    return triton_weight_kind(weight) if triton_experts.runs_kernels(x.device) else None


ROWS_PER_CONVERSION = 256  # a multiple of the kernel's 64-row blocks; bounds the int32 working copy
INT4_BLOCK = 64  # rows per block of the CPU int4 layout


def documented_int4_layout(nibbles: torch.Tensor) -> torch.Tensor:
    """``(OUT, IN)`` nibbles (OUT a multiple of 64) in the layout ``dequantize_int4_kernel_layout``
    reads: per block of 64 rows, an ``(IN, 32)`` byte matrix, row ``64b + j`` in the low nibble of
    byte ``[k, j]``, row ``64b + 32 + j`` in its high nibble. Returns ``(OUT, IN/2)`` uint8."""
    out_features, in_features = nibbles.shape
    blocks = nibbles.to(torch.uint8).view(out_features // INT4_BLOCK, INT4_BLOCK, in_features)  # (OUT/64, 64, IN)
    half = INT4_BLOCK // 2
    paired = blocks[:, :half] | (blocks[:, half:] << 4)  # (OUT/64, 32, IN)
    return paired.transpose(1, 2).reshape(out_features, in_features // 2)


def int4_cpu_layout_reads_back() -> bool:
    """Whether this machine's ``_convert_weight_to_int4pack_for_cpu`` lays blocks out as
    ``documented_int4_layout`` (and so ``dequantize_int4_kernel_layout``) says. The layout is the one
    torch's CPU kernel reads on this CPU, which follows the vector width it runs with (AVX512 and AVX2
    builds differ), so it is probed once, on 64 rows of known nibbles; where it differs, prompts keep
    the int4 kernel instead of reading the layout back. Kept in a global, set when weights are
    prepared (``prepare``): compiled steps read it as a constant, never trace the probe."""
    global _INT4_READS_BACK
    if _INT4_READS_BACK is None:
        _INT4_READS_BACK = _probe_int4_layout()
    return _INT4_READS_BACK


_INT4_READS_BACK: Optional[bool] = None


def _probe_int4_layout() -> bool:
    nibbles = (torch.arange(INT4_BLOCK)[:, None] * 3 + torch.arange(32)[None, :] * 5) % 16  # (64, 32)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32), 1)
    except (RuntimeError, NotImplementedError):  # no CPU int4 kernel in this torch: nothing to read back
        return False
    return packed.shape == (INT4_BLOCK, 16) and torch.equal(packed.view(torch.uint8), documented_int4_layout(nibbles))


def dequantize_int8(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """``weight.dequantize(dtype)`` of an int8 weight, bit for bit, in one conversion and one
    multiply in place: for prompts, where the reference's two float32 copies of the weight cost
    a good part of the product. The same numbers: an integer of at most 127 is exact in any float dtype, and
    PyTorch multiplies 16-bit numbers in float32, where ``q * scale`` is exact, rounding once."""
    return weight.integers().to(dtype).mul_(weight.scales[..., None])  # (..., OUT, IN)


def dequantize_int4_kernel_layout(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The matrix ``(OUT, IN)`` in ``dtype`` of a CPU int4 weight that holds only its kernel layout.

    ``_convert_weight_to_int4pack_for_cpu`` stores each block of 64 rows as an ``(IN, 32)``
    byte matrix: byte ``[k, j]`` of block ``b`` holds row ``64b + j``'s input ``k`` in its low
    nibble and row ``64b + 32 + j``'s in its high nibble (checked against the op for OUT =
    128, 1024, 4096, 14336; other row counts end in a block laid out otherwise, so callers
    keep the kernel for them). Example, OUT = 64, IN = 1: nibbles ``n[0..63]`` are the 32
    bytes ``n[j] | n[32 + j] << 4``.
    """
    packed, _ = weight.packed  # (OUT, IN/2) bytes, in the kernel's order
    out_features, in_features = weight.shape
    blocks = packed.reshape(out_features // INT4_BLOCK, in_features, INT4_BLOCK // 2)  # (OUT/64, IN, 32)
    nibbles = torch.empty(out_features // INT4_BLOCK, INT4_BLOCK, in_features, dtype=dtype)  # (OUT/64, 64, IN)
    nibbles[:, : INT4_BLOCK // 2] = (blocks & 15).transpose(1, 2)  # rows 64b + j
    nibbles[:, INT4_BLOCK // 2 :] = (blocks >> 4).transpose(1, 2)  # rows 64b + 32 + j
    # Written in dtype and scaled in place, as dequantize_int8 (one rounding, the reference's
    # numbers), rather than through float32 copies.
    grouped = nibbles.view(out_features, -1, weight.scheme.group_size).sub_(8)  # (OUT, IN/G, G)
    return grouped.mul_(weight.scales[..., None]).view(out_features, in_features)


def dequantize_nf4_kernel_layout(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight.dequantize(dtype)`` of an nf4 weight ``(OUT, IN)`` held in bitsandbytes' layout, bit for
    bit, for prompts: ``ROWS_PER_CONVERSION`` rows at a time, both values of each byte looked up at once
    (``nf4.byte_values``), put back in row order, scaled in float32 in place and rounded once: faster
    than the readable path (``NF4_DEQUANTIZE_ROWS`` says when it pays). Byte ``t`` of a block's input
    pair ``i`` holds rows ``t // 2`` and
    ``16 + t // 2`` (``nf4.kernel_layout``), inputs ``2i + t % 2``."""
    packed, _ = weight.packed  # (OUT, IN/2), the kernel's layout
    out_features, in_features = weight.shape
    table, block, group = nf4.byte_values(), nf4.ROW_BLOCK, weight.scheme.group_size
    out = torch.empty(out_features, in_features, dtype=dtype)
    for start in range(0, out_features, ROWS_PER_CONVERSION):  # a multiple of the 32-row blocks
        part = packed[start : start + ROWS_PER_CONVERSION]
        rows = part.shape[0]
        # byte t of block b, input pair i -> (b, i, t // 2, t % 2), each byte's [low, high] values last
        codes = part.reshape(rows // block, in_features // 2, block // 2, 2).long()  # (B, IN/2, 16, 2)
        pairs = F.embedding(codes, table)  # (B, IN/2, 16, 2, 2); faster than table[codes] here
        # (b, nibble, t // 2, i, t % 2): row 32b + 16 * nibble + t // 2, input 2i + t % 2
        values = pairs.permute(0, 4, 2, 1, 3).reshape(rows, in_features)
        scales = weight.scales[start : start + rows, :, None].to(torch.float32)  # (rows, IN/G, 1)
        out[start : start + rows] = values.view(rows, -1, group).mul_(scales).view(rows, in_features)
    return out


def prepare(weight: QuantizedWeight, keep_values: bool = False, gemlite_float32_outputs: bool = False) -> QuantizedWeight:
    """Give ``weight`` the layout its device's kernel reads; drop the plain values unless ``keep_values``.

    Only 4-bit weights in bfloat16 have layouts of their own: int4 one per device, nf4 one on CPUs
    that have bitsandbytes' kernel (``_prepare_nf4``); the kernels take the scales' dtype as their
    activations'; other weights keep the plain layout and take the reference path. Both int4
    kernels take the scales as ``(IN/G, OUT, 2)`` pairs ``[scale, 0]`` (they compute
    ``(n - 8) * scale + zero``).

    * CPU, rows in multiples of 16: per expert (``(OUT, IN/2)`` matrix),
      ``_convert_weight_to_int4pack_for_cpu`` of the unsigned nibbles.
    * CUDA, rows in multiples of 8 and inputs of 32: ``tinygemm_layout``. The plain values stay
      (module docstring: prompt chunks dequantize).

    On a GPU where GemLite is installed, int8 and int4 weights it supports get its packed layer
    instead (``weight.gemlite``, ``gemlite_cuda.product``), their plain values kept for prompts; its
    outputs float32 with ``gemlite_float32_outputs`` (``Tuning.gemlite_float32_outputs``).
    """
    if weight.device.type == "cuda" and gemlite_cuda.supports(weight) and gemlite_cuda.library() is not None:
        weight.gemlite = gemlite_cuda.product_or_none(weight, gemlite_float32_outputs)
        if weight.gemlite is not None:
            return weight
    if weight.dtype != torch.bfloat16 or not weight.scheme.four_bit:
        return weight
    if weight.scheme.name == "nf4":
        return _prepare_nf4(weight, keep_values)
    if weight.device.type == "cuda":
        if weight.shape[-2] % 8 == 0 and cuda_inner_k_tiles(weight.in_features) is not None:
            weight.packed = tinygemm_layout(weight, torch.ops.aten._convert_weight_to_int4pack)
        return weight
    if weight.device.type != "cpu" or weight.shape[-2] % 16:
        return weight
    int4_cpu_layout_reads_back()  # probed now, outside any compiled step that will ask
    def convert(part: torch.Tensor) -> torch.Tensor:  # (rows, IN/2) plain bytes -> the kernel's
        nibbles = torch.stack([part & 15, part >> 4], dim=-1).flatten(-2).to(torch.int32)  # (rows, IN)
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)

    return _in_kernel_layout(weight, convert, _scales_and_zeros(weight), keep_values)


def _in_kernel_layout(weight: QuantizedWeight, convert: Callable, scales: torch.Tensor, keep_values: bool):
    """``weight`` with ``packed = (bytes, scales)``, the bytes its plain ones rewritten by ``convert``
    ``ROWS_PER_CONVERSION`` rows at a time, one expert at a time (the CPU layouts are blocked by 32
    or 64 rows, the CUDA nf4 one is byte by byte: slices convert alike). Without ``keep_values``
    the kernel layout overwrites the plain one, and the plain values are dropped: no new memory
    for the bytes."""
    packed = weight.values.clone() if keep_values else weight.values  # (..., OUT, IN/2)
    for matrix in packed.view(-1, *packed.shape[-2:]):  # one expert (OUT, IN/2) at a time, in place
        for start in range(0, matrix.shape[0], ROWS_PER_CONVERSION):
            part = matrix[start : start + ROWS_PER_CONVERSION]
            part.copy_(convert(part))
    weight.packed = (packed, scales)
    if not keep_values:
        weight.values = None
    return weight


def _prepare_nf4(weight: QuantizedWeight, keep_values: bool) -> QuantizedWeight:
    """``packed = (bytes, scales)`` in the layout of bitsandbytes' kernel for the device: on a CPU
    that has the kernel, for rows in multiples of 32, ``nf4.kernel_layout`` (scales ``(..., IN/G,
    OUT)``); on a GPU where bitsandbytes' CUDA library loads, ``with_cuda_nf4_layout``."""
    if weight.device.type == "cuda" and nf4.cuda_kernel() is not None:
        return with_cuda_nf4_layout(weight, keep_values)
    if weight.device.type != "cpu" or weight.shape[-2] % nf4.ROW_BLOCK or nf4.kernel() is None:
        return weight
    return _in_kernel_layout(weight, nf4.kernel_layout, weight.scales.transpose(-1, -2).contiguous(), keep_values)


def with_cuda_nf4_layout(weight: QuantizedWeight, keep_values: bool = False) -> QuantizedWeight:
    """``weight`` with ``packed = (nf4.cuda_layout(values), scales as float32 (..., OUT, IN/G))``,
    what bitsandbytes' CUDA kernel reads, written over the plain bytes unless ``keep_values``. On any
    device: the CPU tests build it and read it back through bitsandbytes' CPU reader of that format."""
    return _in_kernel_layout(weight, nf4.cuda_layout, weight.scales.to(torch.float32).contiguous(), keep_values)


def _scales_and_zeros(weight: QuantizedWeight) -> torch.Tensor:
    """The int4 kernels' scales: ``(..., IN/G, OUT, 2)`` pairs ``[scale, 0]`` of ``scales (..., OUT, IN/G)``."""
    scales = weight.scales.transpose(-1, -2)  # (..., IN/G, OUT)
    return torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()


CUDA_INT4_DEQUANTIZE_ROWS = 64  # CUDA int4: from this many rows on, dequantize + F.linear (module docstring)


# tinygemm's tiling along the inputs: it reads 16 x tiles inputs per step, tiles in {2, 4, 8}.
# gpt-fast uses 8; at batch 1, 2 reads Mistral 7B's shapes faster.
CUDA_INNER_K_TILES = 2


def cuda_inner_k_tiles(in_features: int) -> Optional[int]:
    """The tiling tinygemm's layout takes for ``in_features`` inputs (``CUDA_INNER_K_TILES``), or None
    when they are not a multiple of 16 x that (no tiling divides them then: 4 and 8 need more)."""
    return CUDA_INNER_K_TILES if in_features % (16 * CUDA_INNER_K_TILES) == 0 else None


def tinygemm_bytes(values: torch.Tensor) -> torch.Tensor:
    """Plain int4 bytes ``(..., OUT, IN/2)`` in the order ``_convert_weight_to_int4pack`` reads them.

    The plain layout keeps input 2j in a byte's low nibble and 2j + 1 in its high one; tinygemm
    (like gpt-fast's and torchao's packing, ``q[:, ::2] << 4 | q[:, 1::2]``) wants input 2j high.
    Byte 95 = 15 | 5 << 4 (inputs [15, 5]) becomes 15 << 4 | 5 = 245: the order of bitsandbytes'
    CUDA format too (``nf4.cuda_layout``, which swaps each byte's nibbles).
    """
    return nf4.cuda_layout(values)


def tinygemm_layout(weight: QuantizedWeight, convert: Callable[[torch.Tensor, int], torch.Tensor]) -> tuple:
    """``(packed, scales_and_zeros)`` for ``_weight_int4pack_mm``: ``convert`` (CUDA's
    ``_convert_weight_to_int4pack``) of each expert's ``tinygemm_bytes`` with ``cuda_inner_k_tiles``
    of the inputs, stacked as the experts are; the scales as the CPU kernel takes them."""
    tiles = cuda_inner_k_tiles(weight.in_features)
    plain = tinygemm_bytes(weight.values)  # (..., OUT, IN/2)
    matrices = [convert(matrix.contiguous(), tiles) for matrix in plain.view(-1, *plain.shape[-2:])]
    packed = torch.stack(matrices).view(*plain.shape[:-2], *matrices[0].shape)  # (..., <tinygemm's tiles>)
    return packed, _scales_and_zeros(weight)
