"""The matrix products of quantized weights: PyTorch's weight-only kernels, chosen per device.

Measured on the 2-core Xeon (avx512_bf16) with torch 2.13.0 and torchao 0.18.0,
``bench/bench_quant_kernels.py``, 1-8 rows of bfloat16 times a 14336 x 1024 weight:

* **CPU int8**: ``torch.ops.aten._weight_int8pack_mm`` (reads the int8 weight at the speed
  ``F.linear`` reads bfloat16, so half the time). torchao's ``Int8WeightOnlyConfig`` runs a
  dequantize-then-matmul on CPU, 20x slower.
* **CPU int4**: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the layout made by
  ``_convert_weight_to_int4pack_for_cpu``. torchao 0.18 has no CPU int4 layout any more
  (``Int4WeightOnlyConfig`` needs the CUDA-only ``mslk`` package).
* **CPU int8 with many rows** (prefill chunks of at least ``DEQUANTIZE_ROWS``): dequantizing
  to bfloat16 (2 ms) and multiplying with ``F.linear`` beats the int8 kernel, which is
  compute-bound there: 3584 x 1024, 512 rows 25 vs 29 ms, 2048 rows 102 vs 119 ms (128 rows:
  8.0 vs 7.5 ms). int4, where ``fast.cpu_upcast`` multiplies in float32, reads its kernel
  layout back (``dequantize_int4_kernel_layout``, 15 ms: its plain values are dropped) from
  ``INT4_DEQUANTIZE_ROWS`` rows on: 1024 rows 59 vs 111 ms, 2048 rows 107 vs 222 ms (512: even).
* Both CPU kernels are vectorised for bfloat16 activations only (float32: 10-50x slower),
  so float32 and float16 activations take the reference path: dequantize, then ``F.linear``.
* **CUDA**: int8 as gpt-fast does it, ``F.linear(x, q.to(x.dtype)) * scales`` (compiled, the
  conversion fuses into the product); int4 dequantizes first. Not measured: no GPU was lent
  to the session that wrote this (``bench/bench_gpu.py`` has the rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_upcast import should_upcast, upcast_linear
from mixtral_infer.quant.weights import QuantizedWeight


def reference_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x (M, IN) @ dequantize(weight).T`` -> ``(M, OUT)``: the readable path the kernels must equal."""
    return F.linear(x, weight.dequantize(x.dtype))


def uses_cpu_kernel(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.scales.dtype == torch.bfloat16


DEQUANTIZE_ROWS = 512  # CPU int8: from this many rows on, dequantize + F.linear is faster (module docstring)
INT4_DEQUANTIZE_ROWS = 1024  # CPU int4, where float32 multiplies faster: reading the layout back costs more


# One expert of stacked weights, the expert a 0-d tensor (compiled code's routing): these ops
# read it and call the CPU kernel on that expert's views, where a gather would copy the expert's
# weights first (2 experts x 3 matrices per layer per token; mixtral-bench int4 compiled decode
# 48 -> 72 tokens/s, bench/llamacpp/results_decode_compiled*.json). Declared with
# torch.library.Library, as fast.cpu_packed's op: the dispatcher calls the function directly.
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
    if weight.scheme.name == "int4" and weight.packed is not None:
        packed, scales_and_zeros = weight.packed
        return torch.ops.mixtral_infer.int4_expert_mm(x, packed, weight.scheme.group_size, scales_and_zeros, weight.expert)
    return None


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x (M, IN) @ weight.T`` -> ``(M, OUT)`` through the device's kernel (module docstring)."""
    if weight.expert is not None:
        out = expert_kernel_linear(x, weight)
        if out is not None:
            return out
        weight = weight.resolved()
    if uses_cpu_kernel(x, weight):
        x = x.contiguous()
        if weight.scheme.name == "int8" and x.shape[0] >= DEQUANTIZE_ROWS:
            if should_upcast(x):  # this CPU multiplies float32 faster (fast.cpu_upcast)
                return upcast_linear(x, weight.dequantize(torch.float32))
            return reference_linear(x, weight)
        if weight.scheme.name == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, weight.values, weight.scales)
        if weight.packed is not None and x.shape[0] >= INT4_DEQUANTIZE_ROWS and should_upcast(x) and weight.shape[-2] % INT4_BLOCK == 0:
            return upcast_linear(x, dequantize_int4_kernel_layout(weight))
        if weight.packed is not None:
            packed, scales_and_zeros = weight.packed
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, weight.scheme.group_size, scales_and_zeros)
    elif x.device.type == "cuda" and weight.scheme.name == "int8":
        return F.linear(x, weight.values.to(x.dtype)) * weight.scales.to(x.dtype)
    return reference_linear(x, weight)


ROWS_PER_CONVERSION = 256  # a multiple of the kernel's 64-row blocks; bounds the int32 working copy
INT4_BLOCK = 64  # rows per block of the CPU int4 layout


def dequantize_int4_kernel_layout(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 matrix ``(OUT, IN)`` of a CPU int4 weight that holds only its kernel layout.

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
    low, high = (blocks & 15).transpose(1, 2), (blocks >> 4).transpose(1, 2)  # (OUT/64, 32, IN) each
    nibbles = torch.cat([low, high], dim=1).reshape(out_features, in_features)  # (OUT, IN), unsigned
    grouped = nibbles.to(torch.float32).view(out_features, -1, weight.scheme.group_size) - 8  # (OUT, IN/G, G)
    return (grouped * weight.scales.to(torch.float32)[..., None]).view(out_features, in_features)


def prepare(weight: QuantizedWeight, keep_values: bool = False) -> QuantizedWeight:
    """Give ``weight`` the layout its device's kernel reads; drop the plain values unless ``keep_values``.

    Only CPU int4 has a layout of its own: per expert (``(OUT, IN/2)`` matrix),
    ``_convert_weight_to_int4pack_for_cpu`` of the unsigned nibbles, and the scales as
    ``(IN/G, OUT, 2)`` pairs ``[scale, 0]`` (the kernel computes ``(n - 8) * scale + zero``).
    Its rows must come in multiples of 16, and its activations in bfloat16 (the scales'
    dtype); other weights keep the plain layout and take the reference path.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.scheme.name != "int4" or weight.shape[-2] % 16:
        return weight
    # Without keep_values the kernel layout overwrites the plain one: no new memory for the weight.
    packed = weight.values.clone() if keep_values else weight.values  # (..., OUT, IN/2)
    scales_and_zeros = torch.zeros(*weight.scales.shape[:-2], weight.scales.shape[-1], weight.scales.shape[-2], 2, dtype=weight.dtype)
    scales_and_zeros[..., 0] = weight.scales.transpose(-1, -2)  # (..., IN/G, OUT, 2): [scale, 0]
    rows = ROWS_PER_CONVERSION
    for matrix in packed.view(-1, *packed.shape[-2:]):  # one expert (OUT, IN/2) at a time, in place
        for start in range(0, matrix.shape[0], rows):  # the layout is blocked by 64 rows: slices convert alike
            part = matrix[start : start + rows]
            nibbles = torch.stack([part & 15, part >> 4], dim=-1).flatten(-2).to(torch.int32)  # (rows, IN)
            part.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1))
    weight.packed = (packed, scales_and_zeros)
    if not keep_values:
        weight.values = None
    return weight
