"""nf4 weights (4-bit NormalFloat, ``quant/nf4.py``): bitsandbytes' kernels.

* **CPU**: bitsandbytes' AVX512-BF16 kernel (``quant.nf4.kernel()``), through the op
  ``mixtral_infer::nf4_mm``, for fewer than ``NF4_DEQUANTIZE_ROWS`` rows of bfloat16; more rows
  dequantize (``dequantize_nf4_kernel_layout``, the reference's numbers); no kernel on this CPU: the
  reference. Weights that multiply the same input (``wq wk wv``, ``w1 w3``) are joined side by side at
  load (``join_side_by_side``) and read in one call of the kernel (``joined_linear``).
* **CUDA**: bitsandbytes' fused kernel (``quant.nf4.cuda_kernel()``, ``cgemm_4bit_bf16``), through the
  op ``mixtral_infer::nf4_cuda_mm``, for fewer than ``CUDA_NF4_KERNEL_ROWS`` rows; more rows, or no
  library for this CUDA: the reference.

``CUDA_NF4_KERNEL_ROWS`` follows the library's own dispatch.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mixtral_infer.fast.cpu_packed import side_by_side_groups
from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend
from mixtral_infer.kernels.linear.quantized_common import DEQUANTIZE_ROWS, ROWS_PER_CONVERSION, in_kernel_layout
from mixtral_infer.kernels.linear.quantized_common import uses_cpu_kernel
from mixtral_infer.kernels.linear.reference import reference_linear
from mixtral_infer.memory import release_freed_memory
from mixtral_infer.quant import nf4
from mixtral_infer.quant.weights import QuantizedParameter, QuantizedWeight
from mixtral_infer.tuning import Tuning

NF4_DEQUANTIZE_ROWS = 1024  # CPU nf4: from this many rows on, dequantize_nf4_kernel_layout + F.linear
# CUDA nf4: below this many rows, bitsandbytes' fused kernel; from it on, dequantize + F.linear.
# bitsandbytes' own dispatch on Hopper keeps its kernel for up to 4 rows always and for 5-7 on most
# shapes, and hands larger weights from 8 rows on to dequantize + F.linear on many shapes.
CUDA_NF4_KERNEL_ROWS = 8


def nf4_layout(weight: QuantizedWeight) -> Optional[str]:
    """Which of bitsandbytes' layouts an nf4 ``weight.packed`` holds (``nf4.held_layout``), or None."""
    return None if weight.packed is None else nf4.held_layout(weight.packed)


def uses_cuda_nf4_kernel(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """(Whether the library loads is not asked here, where compiled code is traced: weights get the
    CUDA layout only where it loaded, and the op falls back to the reference where it does not.)"""
    return x.device.type == "cuda" and x.dtype == weight.dtype == torch.bfloat16 and x.shape[0] < CUDA_NF4_KERNEL_ROWS


class Nf4Linear(LinearBackend):
    """nf4 codes and scales (``quant.weights.QuantizedWeight``) (module docstring)."""

    @classmethod
    def reads(cls, weight: object) -> bool:
        return isinstance(weight, QuantizedWeight) and weight.scheme.name == "nf4"

    @classmethod
    def prepare(cls, weight: object, tuning: Tuning, keep_values: bool = False) -> bool:
        """``packed = (bytes, scales)`` in the layout of bitsandbytes' kernel for the device, for
        bfloat16 scales: on a CPU that has the kernel, for rows in multiples of 32,
        ``nf4.kernel_layout`` (scales ``(..., IN/G, OUT)``); on a GPU where bitsandbytes' CUDA
        library loads, ``with_cuda_nf4_layout``."""
        if not cls.reads(weight) or weight.dtype != torch.bfloat16:
            return False
        if weight.device.type == "cuda" and nf4.cuda_kernel() is not None:
            with_cuda_nf4_layout(weight, keep_values)
        elif weight.device.type == "cpu" and weight.shape[-2] % nf4.ROW_BLOCK == 0 and nf4.kernel() is not None:
            in_kernel_layout(weight, nf4.kernel_layout, weight.scales.transpose(-1, -2).contiguous(), keep_values)
        return True

    @classmethod
    def prepare_model(cls, model: nn.Module, tuning: Tuning, pack: bool | str) -> None:
        join_side_by_side(model)

    @staticmethod
    def product(x: torch.Tensor, weight: QuantizedWeight, tuning: Tuning = DEFAULT) -> torch.Tensor:
        if weight.expert is not None:
            if uses_cpu_kernel(x, weight) and x.shape[0] < DEQUANTIZE_ROWS and nf4_layout(weight) == "cpu":
                expert_mm = torch.ops.mixtral_infer.nf4_expert_mm
                return expert_mm(x.contiguous(), *weight.packed, weight.scheme.group_size, weight.expert)
            weight = weight.resolved()
        layout = nf4_layout(weight)
        if layout == "cuda" and uses_cuda_nf4_kernel(x, weight):
            return torch.ops.mixtral_infer.nf4_cuda_mm(x.contiguous(), *weight.packed, weight.scheme.group_size)
        if layout == "cpu" and uses_cpu_kernel(x, weight):
            if x.shape[0] < NF4_DEQUANTIZE_ROWS:
                return torch.ops.mixtral_infer.nf4_mm(x.contiguous(), *weight.packed, weight.scheme.group_size)
            if weight.packed[0].dim() == 2:  # prompts: reference_linear's numbers, dequantized faster
                return F.linear(x, dequantize_nf4_kernel_layout(weight, x.dtype))
        return reference_linear(x, weight)

    @classmethod
    def products(cls, x: torch.Tensor, weights: Sequence, tuning: Tuning = DEFAULT) -> List[torch.Tensor]:
        """Weights joined side by side at load: one call of the kernel (``joined_linear``)."""
        joined = joined_linear(x, weights)
        return joined if joined is not None else [cls.product(x, weight, tuning) for weight in weights]


def joined_linear(x: torch.Tensor, weights: Sequence[QuantizedWeight]) -> Optional[List[torch.Tensor]]:
    """``[Nf4Linear.product(x, w) for w in weights]`` in one call of the nf4 kernel, where ``weights``
    are a whole group joined side by side (``join_side_by_side``), in order, of one
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


def with_cuda_nf4_layout(weight: QuantizedWeight, keep_values: bool = False) -> QuantizedWeight:
    """``weight`` with ``packed = (nf4.cuda_layout(values), scales as float32 (..., OUT, IN/G))``,
    what bitsandbytes' CUDA kernel reads, written over the plain bytes unless ``keep_values``. On any
    device: the CPU tests build it and read it back through bitsandbytes' CPU reader of that format."""
    return in_kernel_layout(weight, nf4.cuda_layout, weight.scales.to(torch.float32).contiguous(), keep_values)


def join_side_by_side(model: nn.Module) -> nn.Module:
    """nf4 weights in the kernel's layout that multiply the same input (``wq wk wv``, ``w1 w3``;
    ``fast.cpu_packed.SIDE_BY_SIDE``) joined, in place: their bytes one matrix, rows after rows (the
    layout is blocked by 32 rows, so joined rows are the members' layouts one after the other), and
    their scales one ``(IN/G, OUT)`` matrix. ``Nf4Linear.products`` then multiplies a
    group in one call of the kernel instead of one a weight (each call has a fixed cost around the
    kernel: docs/performance.md, section 6). The group's first weight holds the joined
    tensors (``joined``); each weight's own bytes become a view of them (no second copy), its own
    scales stay (the kernel reads a weight's scales whole)."""
    modules = dict(model.named_modules())
    names = [name for name, module in modules.items()
             if isinstance(module, QuantizedParameter) and module.scheme.name == "nf4"
             and nf4_layout(module) == "cpu" and module.joined_rows is None]  # fmt: skip
    for group in side_by_side_groups(names, lambda name: modules[name].shape):
        members = [modules[name] for name in group]
        if len(members) < 2:
            continue
        values = torch.cat([m.kernel_values for m in members], dim=-2)  # (..., OUT_all, IN/2)
        members[0].joined_values = values
        members[0].joined_scales = torch.cat([m.kernel_scales for m in members], dim=-1)  # (..., IN/G, OUT_all)
        start = 0
        for member in members:
            stop = start + member.shape[-2]
            member.kernel_values = values[..., start:stop, :]
            member.joined_rows = (start, stop, values.shape[-2])
            start = stop
        release_freed_memory()  # the members' own bytes, now copied: their pages back to the system
    return model
