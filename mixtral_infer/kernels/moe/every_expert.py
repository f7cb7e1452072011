"""Every expert batched: every expert on every row as one batched product, mixed by a routing
matrix that is zero where a row did not choose the expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixtral_infer.kernels.moe.products import expert_products
from mixtral_infer.model.moe import MoeLayer


def every_expert_batched(
    moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Every expert on every row of ``x (B, D)`` as one batched product, mixed by the routing matrix."""
    mix = routing_matrix(experts, weights, moe.w1.shape[0])  # (B, E)
    hidden = F.silu(expert_products(x[None], moe.w1)) * expert_products(x[None], moe.w3)  # (E, B, I)
    out = expert_products(hidden, moe.w2)  # (E, B, D)
    return torch.einsum("ebd,be->bd", out, mix)


def routing_matrix(experts: torch.Tensor, weights: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``(B, E)``: row b's mixing weight for expert e where b chose e (``experts (B, A)``), else 0."""
    mix = torch.zeros(experts.shape[0], n_experts, dtype=weights.dtype, device=weights.device)
    return mix.scatter(1, experts, weights)
