"""Many-row float32 matmuls through oneDNN, on the CPUs where it multiplies faster than MKL.

``F.linear`` on float32 CPU tensors calls MKL's GEMM. PyTorch ships a second library, oneDNN
(what it calls for bfloat16), whose product takes the same plain weight
(``torch.ops.mkldnn._linear_pointwise``, no copy kept). Which is faster depends on the CPU, so the
choice is ``Tuning.onednn_float32``: measured once per machine (``onednn_is_faster``, a prompt-sized
product both ways) and taken only with a clear margin (``MARGIN``), so a CPU where MKL is as fast
keeps it (``formats.measured``). Products of fewer rows (decoding) keep ``kernels.linear``'s paths, as do
products that record gradients (oneDNN's op has no backward).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_packed import onednn_linear

ROWS = 256  # products with at least this many rows may go to oneDNN (prompts; as fast.cpu_upcast)
MARGIN = 1.1  # only when oneDNN is at least this much faster


def best_seconds(fn: Callable[[], torch.Tensor], repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, after one untimed (first-call set-up is not its speed)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def onednn_is_faster() -> bool:
    """Whether this CPU's oneDNN multiplies many float32 rows at least ``MARGIN`` times faster than
    MKL: a ``ROWS x 1024`` by ``1024 x 2048`` product both ways, best of 3 (``formats.measured`` asks once
    per machine)."""
    if not torch.backends.mkldnn.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(ROWS, 1024, generator=g), torch.randn(2048, 1024, generator=g)
    return best_seconds(lambda: F.linear(x, weight)) >= MARGIN * best_seconds(lambda: onednn_linear(x, weight))


def uses_onednn(x: torch.Tensor, weight: torch.Tensor, onednn: bool) -> bool:
    """Whether ``float32_linear`` hands this product to oneDNN: asked to (``onednn``), and a float32
    CPU product of at least ``ROWS`` rows, outside compiled code, recording no gradient."""
    if not onednn or x.dim() != 2 or x.shape[0] < ROWS or x.device.type != "cpu":
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return False
    return torch.backends.mkldnn.is_available()


def float32_linear(x: torch.Tensor, weight: torch.Tensor, onednn: bool = False) -> torch.Tensor:
    """``F.linear(x, weight)`` for float32 inputs ``(M, IN)``, ``(OUT, IN)``; by oneDNN where
    ``onednn`` (``Tuning.onednn_float32``) says it is the faster library here."""
    return onednn_linear(x, weight) if uses_onednn(x, weight, onednn) else F.linear(x, weight)
