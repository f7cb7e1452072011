"""Gathered: each row's chosen experts gathered from the stacked weights into one batched product
per projection (plain experts), or, for int8 experts, their int8 rows gathered and dequantized where
they are read."""

from __future__ import annotations

import torch

from mixtral_infer.kernels.moe.products import mixed_gathered
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.quant.weights import QuantizedWeight


def gathered_experts(moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row ``x (B, D)`` through its chosen ``experts (B, A)``, gathered into one batched product,
    mixed by ``weights (B, A)``: ``(B, D)``."""
    return mixed_gathered(x, moe.w1[experts], moe.w3[experts], moe.w2[experts], weights)


def plain_int8(moe: MoeLayer) -> bool:
    """Whether the experts are int8 weights (weight-only) with their plain values at hand."""
    return all(
        isinstance(w, QuantizedWeight) and w.scheme.name == "int8" and w.scheme.activations is None
        and w.values is not None and w.expert is None
        for w in (moe.w1, moe.w2, moe.w3)
    )  # fmt: skip


def gathered_int8_experts(
    moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``gathered_experts`` for int8 experts: each row's chosen experts' int8 rows gathered, scaled by
    their rows' scales and multiplied, ``(B, D)``. Compiled, the gather, the conversion, the scales
    and the product fuse into one reduction that reads each chosen expert's int8 bytes once (the
    index read on the device); uncompiled it makes the dequantized copies, correct but slow."""

    def dequantized(w: QuantizedWeight) -> torch.Tensor:  # (B, A, OUT, IN) in x's dtype
        return w.values[experts].to(x.dtype) * w.scales[experts][..., None].to(x.dtype)

    return mixed_gathered(x, dequantized(moe.w1), dequantized(moe.w3), dequantized(moe.w2), weights)
