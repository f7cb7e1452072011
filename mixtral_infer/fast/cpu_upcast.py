"""Many-row bfloat16 and float16 matmuls in float32, on the CPUs where float32 is the faster.

Prefill multiplies hundreds of rows by each weight: there the time is arithmetic, not reading the
weight, and which type a CPU multiplies faster depends on the CPU, not on its flags (one that lists
``avx512_bf16`` may still multiply float32 faster). Widening both operands to float32
(``upcast_linear``) gives float32's speed and the same products: a bfloat16 times a bfloat16 is
exact in float32, and oneDNN also adds in float32, so only the order of the additions differs. The
result is rounded back to the input's dtype.

Which dtypes to widen is ``Tuning.upcast``: measured once per machine and dtype
(``upcast_is_faster``, a prompt-sized product both ways) and taken only with a clear margin
(``MARGIN``), so a CPU where the two are close keeps its 16-bit product (``formats.measured``).
Decoding (fewer than ``UPCAST_ROWS`` rows) is never widened: it reads the weight, and 16 bits read
faster.
"""

from __future__ import annotations

from typing import Collection

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_float32 import best_seconds, float32_linear

UPCAST_ROWS = 256  # products with at least this many rows may be widened
MARGIN = 1.25  # widen only when float32 is at least this much faster
WIDE_DTYPES = (torch.bfloat16, torch.float16)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, onednn: bool = False) -> torch.Tensor:
    """``x (M, IN) @ weight (OUT, IN).T`` computed in float32 (by oneDNN where ``onednn``,
    ``fast.cpu_float32``), returned in ``x``'s dtype."""
    return float32_linear(x.float(), weight.float(), onednn).to(x.dtype)


def upcast_is_faster(dtype: torch.dtype, onednn: bool = False) -> bool:
    """Whether this CPU multiplies many rows of ``dtype`` at least ``MARGIN`` times faster in float32
    (by oneDNN where ``onednn``): a ``UPCAST_ROWS x 1024`` by ``1024 x 2048`` product both ways, best
    of 3 (``formats.measured`` asks once per machine)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(UPCAST_ROWS, 1024, generator=g).to(dtype)
    weight = torch.randn(2048, 1024, generator=g).to(dtype)
    narrow = best_seconds(lambda: F.linear(x, weight))
    wide = best_seconds(lambda: upcast_linear(x, weight, onednn))
    return narrow >= MARGIN * wide


def should_upcast(x: torch.Tensor, upcast: Collection[torch.dtype] = ()) -> bool:
    """Whether ``linear`` widens this product: a CPU input of many rows of a dtype in ``upcast``
    (``Tuning.upcast``, the dtypes this CPU multiplies faster in float32), outside compiled code."""
    if x.dim() != 2 or x.shape[0] < UPCAST_ROWS or x.dtype not in upcast or x.device.type != "cpu":
        return False
    return not torch.compiler.is_compiling()
