"""Prefill attention on CUDA without xformers: torch's ragged flash attention.

xformers' kernels only load with the torch build they were compiled for, so on a current
torch ``attention()`` would fall back to one SDPA call per sequence with a dense boolean
mask. ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.11, CUDA, float16/bfloat16) is
the same kind of kernel as xformers' ``memory_efficient_attention`` on a block-diagonal
bias: one launch over the flat batch, sequences given by cumulative offsets, a sliding
window given as ``(left, right)``, no mask in memory.

Every block-diagonal bias the cache produces translates directly (flash attention aligns
each block at its bottom right; a key j is visible to query i of a block with ``q_len``
queries and ``kv_len`` keys when ``i + kv_len - q_len - left <= j <= i + kv_len - q_len + right``,
-1 meaning no limit):

==============================================================  ==================
bias                                                            window_size
==============================================================  ==================
``BlockDiagonalCausalMask`` / ``...FromBottomRightMask``        ``(-1, 0)``
``BlockDiagonalCausalLocalAttention[FromBottomRight]Mask`` W    ``(W - 1, 0)``
==============================================================  ==================

(The top-left causal masks are used only for square blocks, where top-left and bottom-right
alignment agree.) Worked example: window W = 3, a block of 2 queries over 5 keys (3 cached,
2 new): query 0 sits at key 3 and sees keys 1..3, query 1 sees keys 2..4.

``reference_varlen_attention`` spells those semantics out in plain torch, so the argument
translation is tested on any machine; the kernel itself is tested where CUDA is.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from mixtral_infer.model.xformers_bias import (
    BlockDiagonalCausalWithOffsetPaddedKeysMask,
    BlockDiagonalMask,
    block_semantics,
)


@dataclass
class VarlenArguments:
    cu_seq_q: torch.Tensor  # (N+1,) int32: query block starts, then the total
    cu_seq_k: torch.Tensor  # (N+1,) int32: key block starts, then the total
    max_q: int
    max_k: int
    window_size: Tuple[int, int]  # (left, right), -1 for no limit


def window_size_of(bias: BlockDiagonalMask) -> Tuple[int, int]:
    """Flash attention's ``(left, right)`` window for a block-diagonal bias (table above)."""
    _, window = block_semantics(bias)  # bottom-right alignment is flash's own
    return (window - 1, 0) if window is not None else (-1, 0)


def varlen_arguments(bias: BlockDiagonalMask, device: torch.device) -> VarlenArguments:
    """The kernel's arguments for ``bias``; the offsets come from the bias, already on its device."""
    q_info, k_info = bias.q_seqinfo, bias.k_seqinfo
    return VarlenArguments(
        cu_seq_q=q_info.seqstart.to(device=device, dtype=torch.int32, non_blocking=True),
        cu_seq_k=k_info.seqstart.to(device=device, dtype=torch.int32, non_blocking=True),
        max_q=q_info.max_seqlen,
        max_k=k_info.max_seqlen,
        window_size=window_size_of(bias),
    )


def reference_varlen_attention(
    query: torch.Tensor,  # (T_q, H, Dh)
    key: torch.Tensor,  # (T_k, H_kv, Dh)
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    window_size: Tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """What ``varlen_attn`` computes, block by block with an explicit mask (for tests)."""
    left, right = window_size
    out = torch.zeros_like(query)
    starts_q, starts_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:])):
        q_len, kv_len = q1 - q0, k1 - k0
        assert q_len <= max_q and kv_len <= max_k
        diagonal = torch.arange(q_len)[:, None] + kv_len - q_len  # (q_len, 1) each query's own key index
        keys = torch.arange(kv_len)[None, :]  # (1, kv_len)
        visible = torch.ones(q_len, kv_len, dtype=torch.bool)
        if left >= 0:
            visible &= keys >= diagonal - left
        if right >= 0:
            visible &= keys <= diagonal + right
        out[q0:q1] = F.scaled_dot_product_attention(
            query[q0:q1].transpose(0, 1), key[k0:k1].transpose(0, 1), value[k0:k1].transpose(0, 1),
            attn_mask=visible.to(query.device), enable_gqa=enable_gqa,
        ).transpose(0, 1)  # fmt: skip
    return out


Kernel = Callable[..., torch.Tensor]


@functools.lru_cache(maxsize=None)
def torch_varlen_kernel() -> Optional[Kernel]:
    """``torch.nn.attention.varlen.varlen_attn`` when this torch has it, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=None)
def kernel_takes_gqa(kernel: Kernel) -> bool:
    """torch 2.11's ``varlen_attn`` has no ``enable_gqa``; 2.13's has."""
    return "enable_gqa" in inspect.signature(kernel).parameters


def varlen_attention(
    q: torch.Tensor,  # (T_q, H, Dh)
    k: torch.Tensor,  # (T_k, H_kv, Dh)
    v: torch.Tensor,
    bias: BlockDiagonalMask,
    kernel: Kernel,
) -> torch.Tensor:
    """Attention of q over k, v under a block-diagonal ``bias``, in one call of ``kernel``."""
    args = varlen_arguments(bias, q.device)
    n_heads, n_kv_heads = q.shape[1], k.shape[1]
    options = {}
    if n_heads != n_kv_heads:
        if kernel_takes_gqa(kernel):
            options["enable_gqa"] = True
        else:  # each KV head serves n_heads / n_kv_heads consecutive query heads, as with enable_gqa
            k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)
            v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)
    return kernel(
        q, k, v, args.cu_seq_q, args.cu_seq_k, args.max_q, args.max_k, window_size=args.window_size, **options
    )  # (T_q, H, Dh)


def can_use_torch_varlen(q: torch.Tensor, bias) -> bool:
    """The torch kernel runs flash attention: CUDA, half precision, block-diagonal biases."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and isinstance(bias, BlockDiagonalMask)
        and not isinstance(bias, BlockDiagonalCausalWithOffsetPaddedKeysMask)
        and torch_varlen_kernel() is not None
    )
