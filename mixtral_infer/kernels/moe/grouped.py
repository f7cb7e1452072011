"""Grouped: the assignments sorted by expert, one grouped product per projection
(``torch._grouped_mm``), each expert's weights read once and only its own rows computed."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixtral_infer.model.moe import MoeLayer


def grouped_experts(moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row of ``x (B, D)`` through its chosen ``experts (B, A)`` as one grouped product per
    projection (``torch._grouped_mm``, CUTLASS's grouped GEMM on CUDA): the B * A assignments sorted
    by expert, each expert's rows ending at ``offsets[e]``, so each expert's weights are read once and
    only its own rows are computed. Everything stays on the device in fixed shapes (the offsets by
    ``scatter_add`` and ``cumsum``, not ``bincount``, whose size follows the data): no host sync, safe
    in a CUDA graph. bfloat16 only (the grouped GEMM's, on CUDA and when compiled). Example, B = 2,
    A = 2, E = 4, experts ``[[2, 0], [2, 3]]``: assignments sorted
    ``[1, 0, 2, 3]`` (by expert 0, 2, 2, 3), counts ``[1, 0, 2, 1]``, offsets ``[1, 1, 3, 4]``."""
    batch, k = experts.shape
    n_experts = moe.w1.shape[0]
    flat = experts.reshape(-1)  # (B*A,)
    order = torch.argsort(flat, stable=True)  # (B*A,) assignments grouped by expert
    counts = torch.zeros(n_experts, dtype=torch.int32, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # (E,) where each expert's rows end
    token = order // k  # (B*A,) the row of each sorted assignment
    rows = x[token]  # (B*A, D)
    gate = torch._grouped_mm(rows, moe.w1.transpose(1, 2), offs=offsets)  # (B*A, I)
    up = torch._grouped_mm(rows, moe.w3.transpose(1, 2), offs=offsets)  # (B*A, I)
    out = torch._grouped_mm(F.silu(gate) * up, moe.w2.transpose(1, 2), offs=offsets)  # (B*A, D)
    mixed = out * weights.reshape(-1)[order, None]  # (B*A, D)
    return torch.zeros_like(x).index_add(0, token, mixed)  # (B, D)
