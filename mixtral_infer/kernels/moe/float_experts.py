"""float32 experts on x86 CPUs through the package's own kernel (``kernels/float_dots.cpp``,
``torch.ops.mixtral_infer_dots.float_experts``), where ``Tuning.float_dots`` says (the machine measured
its few-row product faster, ``formats.measured``).

The operator is given the rows (one token each), the stacked weights as they lie and the routing; it
groups the rows by expert itself, so each chosen expert is read once, for the rows that chose it, with
no gathered copy of a weight. Its shapes are fixed by the rows, so a compiled step calls it as the
eager loop does (a fake implementation gives the shape), where the step's own forms must either read
a chosen expert once per row that chose it or every expert for every row (``strategy``).

Example, 4 rows, top-2 of 8, ``experts = [[0, 3], [3, 5], [0, 1], [3, 7]]``: expert 3 is read once
for rows 0, 1 and 3, experts 0 for rows 0 and 2, and 1, 5 and 7 for one row each; experts 2, 4 and 6
are not read. Row 1's output is ``mix[1, 0] * expert_3(x[1]) + mix[1, 1] * expert_5(x[1])``.

At most ``MAX_ROWS`` rows (decode batches; an expert then gets at most 8, which the kernel reads at
once): prompt chunks keep ``MoeLayer.forward``'s grouping through the weights' back-ends.
"""

from __future__ import annotations

import threading

import torch

from mixtral_infer.kernels import native
from mixtral_infer.kernels.linear.plain import MAX_ROWS
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.tuning import Tuning

_FAKE = False
_LOCK = threading.Lock()


@torch.compiler.assume_constant_result  # a step traced with a tuning of its own asks at trace time
def ready() -> bool:
    """Whether the operator is loaded (built or read from the cache on the first call) and its fake
    implementation registered; asked when a layer's strategy is chosen, before any step is traced
    or a kept compiled step calls it."""
    global _FAKE
    if not native.loaded():
        return False
    with _LOCK:  # two threads choosing strategies at once register it once
        if not _FAKE:

            @torch.library.register_fake("mixtral_infer_dots::float_experts")
            def _(x, w1, w3, w2, experts, mix):
                return x.new_empty(x.shape)

            _FAKE = True
    return True


def plain_float32_experts(moe: MoeLayer) -> bool:
    """Whether the layer holds every expert whole (one process: no experts or columns on other ranks
    to sum with) as stacked, contiguous float32 tensors on the CPU (not quantized, packed or in
    blocks of columns)."""
    weights = (moe.w1, moe.w3, moe.w2)
    return moe.parallel.tensor_parallel == 1 and len(moe.local_experts) == moe.args.num_experts and all(
        isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
        for w in weights
    )


def wanted(moe: MoeLayer, tuning: Tuning) -> bool:
    """Whether the layer's experts go to the operator under ``tuning`` (``float_dots``): plain
    float32 experts, and the operator ready. Asked once, when the strategy is chosen."""
    return tuning.fast and tuning.float_dots and plain_float32_experts(moe) and ready()


def takes_rows(moe: MoeLayer, x: torch.Tensor) -> bool:
    """Whether the call's rows ``x (B, D)`` go to it: at most ``MAX_ROWS`` float32 CPU rows, and no
    gradient recorded, of the rows, the experts or the router (the operator has no backward)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return False
    learning = (x, moe.w1, moe.w3, moe.w2, moe.gate.weight)
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in learning))


def float_experts(moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row of ``x (B, D)`` through its chosen ``experts (B, A)``, mixed by ``weights (B, A)``: ``(B, D)``."""
    return torch.ops.mixtral_infer_dots.float_experts(x, moe.w1, moe.w3, moe.w2, experts, weights)
