"""One by one: experts as loops of fixed length over their 2-D weights, each product through
``kernels.linear``' back-ends (which, quantized or packed, take one 2-D weight at a time); the chosen
experts one row each, or every expert on every row."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_reductions import expert_of
from mixtral_infer.kernels.linear import backend_for
from mixtral_infer.kernels.moe.every_expert import routing_matrix
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.tuning import Tuning


def expert(moe: MoeLayer, e: int | torch.Tensor, x: torch.Tensor, tuning: Tuning) -> torch.Tensor:
    """Expert ``e`` of ``moe`` on x ``(N, D)`` through its weights' back-ends (chosen when the layer was
    swapped in, ``FastMoeLayer.expert_backends``; ``e`` a 0-d tensor in compiled steps, read in place:
    ``expert_of``), as ``tuning`` says: ``(N, D)``."""
    w1, w3, w2 = expert_of(moe.w1, e), expert_of(moe.w3, e), expert_of(moe.w2, e)
    backends = getattr(moe, "expert_backends", None) or {"w1": backend_for(w1, tuning), "w2": backend_for(w2, tuning)}
    gate, up = backends["w1"].products(x, (w1, w3), tuning)  # (N, I) each
    return backends["w2"].product(F.silu(gate) * up, w2, tuning)


def experts_one_by_one(
    moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, tuning: Tuning
) -> torch.Tensor:
    """``gathered_experts`` as a loop of fixed length: the B * A chosen experts, one row each, each
    expert's 2-D weight through ``linear()`` (``expert``; ``e`` a 0-d tensor, read in place).
    Compiled on CPU, inductor fuses the experts' reductions into shared loops, so their products
    read in the tuning's places for the experts (``Tuning.for_experts``; ``cpu_reductions``, "The
    chosen experts")."""
    batch, k = experts.shape
    tuning = tuning.for_experts()
    out = [
        sum(expert(moe, experts[b, j], x[b : b + 1], tuning) * weights[b, j] for j in range(k))  # (1, D)
        for b in range(batch)
    ]
    return torch.cat(out)  # (B, D)


def every_expert_one_by_one(
    moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, tuning: Tuning
) -> torch.Tensor:
    """``every_expert_batched`` as a loop over the E experts, each on every row of ``x (B, D)``."""
    mix = routing_matrix(experts, weights, moe.w1.shape[0])  # (B, E)
    return sum(expert(moe, e, x, tuning) * mix[:, e : e + 1] for e in range(moe.w1.shape[0]))
