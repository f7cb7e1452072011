"""The batched expert products the gathered and every-expert strategies share: stacked experts
``(..., OUT, IN)`` times each expert's own rows, and the SwiGLU of rows through gathered experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_column_blocks import ColumnBlocks


def expert_products(rows: torch.Tensor, weight: torch.Tensor | ColumnBlocks) -> torch.Tensor:
    """``rows (..., N, IN)`` times ``weight (..., OUT, IN)``, each leading index its own expert:
    ``(..., N, OUT)``. Rows that several experts share (size-1 leading dimensions of ``rows``) are
    copied out to each expert first: einsum folds a broadcast dimension into the product's outputs,
    one product of all the experts side by side, which in bfloat16 on CPU runs many times slower.
    A weight in column blocks ``(..., n, OUT, B)``
    (``fast.cpu_column_blocks``) is multiplied block by block, summed."""
    rows = rows.expand(*weight.shape[:-2], *rows.shape[-2:]).contiguous()  # (..., N, IN): a copy per expert
    if isinstance(weight, ColumnBlocks):
        parts = rows.unflatten(-1, (weight.blocks.shape[-3], -1))  # (..., N, n, B)
        return torch.einsum("...xnj,...ndj->...nxd", parts, weight.blocks).sum(-3)
    return torch.einsum("...xi,...di->...xd", rows, weight)


def mixed_gathered(
    x: torch.Tensor,  # (B, D)
    w1: torch.Tensor,  # (B, A, I, D) each row's chosen experts
    w3: torch.Tensor,  # (B, A, I, D)
    w2: torch.Tensor,  # (B, A, D, I)
    weights: torch.Tensor,  # (B, A)
) -> torch.Tensor:
    """The SwiGLU of each row through its own gathered experts, mixed by ``weights``: ``(B, D)``."""
    rows = x[:, None, None, :]  # (B, 1, 1, D): each row against its own A experts
    hidden = F.silu(expert_products(rows, w1)) * expert_products(rows, w3)  # (B, A, 1, I)
    out = expert_products(hidden, w2)[:, :, 0]  # (B, A, D)
    return torch.einsum("bkd,bk->bd", out, weights)
