"""Many-row bfloat16 and float16 matmuls in float32, on the CPUs where float32 is the faster.

Prefill multiplies hundreds of rows by each weight: there the time is arithmetic, not
reading the weight, and which type a CPU multiplies faster depends on the CPU, not on its
flags. Measured with torch 2.13.0, 2 cores, (rows x 1024) @ (1024 x 3584):

=====================================  ====================  =================================
256 rows                                2-core Intel Xeon     2-core AMD EPYC (earlier session)
=====================================  ====================  =================================
bfloat16 ``F.linear`` (oneDNN)          11.9 ms               ~3x faster than float32
float32 ``F.linear`` (MKL)              7.2 ms
=====================================  ====================  =================================

On the Xeon (avx512_bf16 listed, AMX not exposed by the VM) a bfloat16 model therefore
prefilled at 0.68x the speed of the same model in float32 (mistral-bench 636 against 941
tokens/s). Widening both operands to float32 (``upcast_linear``) gives float32's speed (926)
and the same products: a bfloat16 times a bfloat16 is exact in float32, and oneDNN also adds
in float32, so only the order of the additions differs. The result is rounded back to the
input's dtype.

Whether to widen is measured once per process and dtype (``upcast_is_faster``: a 256 x 1024
by 1024 x 2048 product both ways, best of 3, about 50 ms) and taken only with a clear margin
(``MARGIN``), so a CPU where the two are close keeps its 16-bit product. ``upcast`` forces
the choice (True / False; None = measure). Decoding (fewer than ``UPCAST_ROWS`` rows) is never
widened: it reads the weight, and 16 bits read faster.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_float32 import best_seconds, float32_linear

UPCAST_ROWS = 256  # products with at least this many rows may be widened
MARGIN = 1.25  # widen only when float32 is at least this much faster
WIDE_DTYPES = (torch.bfloat16, torch.float16)
upcast: Optional[bool] = None  # True / False forces the choice; None: measured once


def upcast_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x (M, IN) @ weight (OUT, IN).T`` computed in float32 (by the faster library, ``fast.cpu_float32``),
    returned in ``x``'s dtype."""
    return float32_linear(x.float(), weight.float()).to(x.dtype)


@functools.lru_cache(maxsize=None)
def upcast_is_faster(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies many rows of ``dtype`` at least ``MARGIN`` times faster in float32."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(UPCAST_ROWS, 1024, generator=g).to(dtype)
    weight = torch.randn(2048, 1024, generator=g).to(dtype)
    narrow = best_seconds(lambda: F.linear(x, weight))
    wide = best_seconds(lambda: upcast_linear(x, weight))
    return narrow >= MARGIN * wide


def should_upcast(x: torch.Tensor) -> bool:
    """Whether ``linear`` widens this product: a CPU 16-bit float input of many rows, where it pays."""
    if x.dim() != 2 or x.shape[0] < UPCAST_ROWS or x.dtype not in WIDE_DTYPES or x.device.type != "cpu":
        return False
    if torch.compiler.is_compiling():
        return False
    return upcast_is_faster(x.dtype) if upcast is None else upcast
