"""Triton: every row's chosen experts in two launches of ``fast.triton_experts``' kernels, the
weights (plain, int8 or int4) read once, in place, dequantized where they are read."""

from __future__ import annotations

from typing import Optional

import torch

from mixtral_infer.fast import triton_experts
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.kernels.linear.triton import triton_weight_kind
from mixtral_infer.quant.weights import QuantizedWeight


def triton_kind(moe: MoeLayer, x: torch.Tensor) -> Optional[int]:
    """The kind of weight ``fast.triton_experts`` reads these experts as (``PLAIN``, ``INT8``, ``INT4``),
    or None where its kernels do not take them: weights packed for a CPU kernel, in another dtype than
    x, or quantized weights it does not take (``kernels.linear.triton.triton_weight_kind``); a rank's share of
    the experts (expert parallelism)."""
    weights = (moe.w1, moe.w2, moe.w3)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or len(moe.local_experts) != moe.args.num_experts:
        return None
    if all(isinstance(w, torch.Tensor) and w.dtype == x.dtype for w in weights):  # (packed layouts are not tensors)
        return triton_experts.PLAIN
    if not all(isinstance(w, QuantizedWeight) and w.scheme == moe.w1.scheme for w in weights):
        return None
    kind = triton_weight_kind(moe.w1)
    return kind if all(triton_weight_kind(w) == kind for w in weights) else None


def triton_experts_kind(moe: MoeLayer, x: torch.Tensor) -> Optional[int]:
    """``triton_kind`` where the Triton kernels run on x's device, else None (the caller asks only
    where the tuning sends these experts through them, ``Tuning.triton_experts``)."""
    if not triton_experts.runs_kernels(x.device):
        return None
    return triton_kind(moe, x)


def triton_mixture(
    moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, kind: int
) -> torch.Tensor:
    """Each row of ``x (B, D)`` through its chosen ``experts (B, A)``, mixed by ``weights (B, A)``, in
    two Triton launches (``fast.triton_experts.mixture``), the weights read as ``kind``: ``(B, D)``."""

    def parts(w) -> tuple:  # (weight, scales) as the kernels take them
        return (w, None) if kind == triton_experts.PLAIN else (w.values, w.scales)

    return triton_experts.mixture(x, experts, weights, *parts(moe.w1), *parts(moe.w3), *parts(moe.w2), kind)
