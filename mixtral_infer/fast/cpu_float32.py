"""Many-row float32 matmuls through oneDNN, on the CPUs where it multiplies faster than MKL.

``F.linear`` on float32 CPU tensors calls MKL's GEMM. PyTorch ships a second library, oneDNN
(what it calls for bfloat16), whose product takes the same plain weight
(``torch.ops.mkldnn._linear_pointwise``, no copy kept). Which is faster depends on the CPU. Measured
with torch 2.13.0, 2 cores, (2048 x 1024) @ (1024 x 3584), ms:

=======================  ==========  ==========
CPU                       MKL         oneDNN
=======================  ==========  ==========
2-core AMD EPYC           94.8        81.2
=======================  ==========  ==========

so a float32 model's prompts there (mistral-bench, 2048 tokens) prefill at 716 tokens/s instead of
631 (one process alternating, medians of 3). The choice is measured once per process
(``onednn_is_faster``: a 256 x 1024 by 1024 x 2048 product both ways, best of 3, about 30 ms) and
taken only with a clear margin (``MARGIN``), so a CPU where MKL is as fast (the Intel Xeon of the
other tables is not measured) keeps it. ``onednn`` forces the choice (True / False; None =
measure). Products of fewer rows (decoding) keep ``fast.linear``'s paths, as do products that
record gradients (oneDNN's op has no backward).
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_packed import onednn_linear

ROWS = 256  # products with at least this many rows may go to oneDNN (prompts; as fast.cpu_upcast)
MARGIN = 1.1  # only when oneDNN is at least this much faster
onednn: Optional[bool] = None  # True / False forces the choice; None: measured once


def best_seconds(fn: Callable[[], torch.Tensor], repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, after one untimed (first-call set-up is not its speed)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@functools.lru_cache(maxsize=None)
def onednn_is_faster() -> bool:
    """Whether this CPU's oneDNN multiplies many float32 rows at least ``MARGIN`` times faster than MKL."""
    if not torch.backends.mkldnn.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(ROWS, 1024, generator=g), torch.randn(2048, 1024, generator=g)
    return best_seconds(lambda: F.linear(x, weight)) >= MARGIN * best_seconds(lambda: onednn_linear(x, weight))


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dim() != 2 or x.shape[0] < ROWS or x.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return False
    return onednn_is_faster() if onednn is None else onednn


def float32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for float32 inputs ``(M, IN)``, ``(OUT, IN)``, by the faster library here."""
    return onednn_linear(x, weight) if uses_onednn(x, weight) else F.linear(x, weight)
