"""What the quantized back-ends (``int8``, ``int4``, ``nf4``) share: when PyTorch's and
bitsandbytes' CPU kernels apply, and rewriting plain bytes into a kernel's layout in place.

The CPU kernels are vectorised for bfloat16 activations only (float32 is many times slower), so
float32 and float16 activations take the reference path: dequantize, then ``F.linear``.
"""

from __future__ import annotations

from typing import Callable

import torch

from mixtral_infer.quant.weights import QuantizedWeight

DEQUANTIZE_ROWS = 512  # CPU int8 (and one expert of any kind): from this many rows on, dequantize + F.linear is faster
ROWS_PER_CONVERSION = 256  # a multiple of the kernels' 32- and 64-row blocks; bounds the int32 working copy


def uses_cpu_kernel(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.scales.dtype == torch.bfloat16


def in_kernel_layout(weight: QuantizedWeight, convert: Callable, scales: torch.Tensor, keep_values: bool) -> QuantizedWeight:
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
