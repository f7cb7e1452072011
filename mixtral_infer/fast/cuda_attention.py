"""Attention on CUDA: xformers' kernels where they load, else torch's ragged flash attention
(``fast.varlen_attention``) for the prefill biases, else SDPA (``fast.batched_attention``). ``CudaAttention`` is swapped in for the model's ``Attention`` by
``formats.modules.use_formats``; on other devices it is the reference."""

from __future__ import annotations

import functools
import logging

import torch

from mixtral_infer.fast.varlen_attention import can_use_torch_varlen, torch_varlen_kernel, varlen_attention
from mixtral_infer.fast.batched_attention import batched_attention
from mixtral_infer.model.xformers_bias import AttentionBias


@functools.lru_cache(maxsize=None)
def xformers_kernels_available() -> bool:
    """True when xformers' CUDA kernels can be used on this machine.

    Without CUDA there is nothing to try, and importing ``xformers.ops`` would only
    print xformers' "can't load C++/CUDA extensions" warning, so it is not imported.
    """
    if not torch.cuda.is_available():
        return False
    try:
        import xformers

        if not getattr(xformers, "_has_cpp_library", False):
            return False
        from xformers.ops import memory_efficient_attention  # noqa: F401
    except Exception as error:  # pragma: no cover - depends on the installed wheel
        logging.getLogger(__name__).warning("xformers kernels unavailable (%s); using torch SDPA", error)
        return False
    return True


def cuda_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: AttentionBias) -> torch.Tensor:
    """``model.attention.attention`` through the fastest kernel that takes these inputs."""
    if q.is_cuda and xformers_kernels_available():
        return _xformers_attention(q, k, v, bias)
    if can_use_torch_varlen(q, bias):
        return varlen_attention(q, k, v, bias, torch_varlen_kernel())
    return batched_attention(q, k, v, bias)


def _xformers_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: AttentionBias) -> torch.Tensor:
    from xformers.ops import memory_efficient_attention

    n_heads, n_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = n_heads // n_kv_heads
    # xformers' grouped layout (its B, M, G, H, K): 1 batch, T tokens, H_kv groups, H/H_kv heads each, Dh.
    q5 = q.view(1, q.shape[0], n_kv_heads, group, head_dim)
    k5 = k.view(1, k.shape[0], n_kv_heads, 1, head_dim).expand(-1, -1, -1, group, -1)
    v5 = v.view(1, v.shape[0], n_kv_heads, 1, head_dim).expand(-1, -1, -1, group, -1)
    out = memory_efficient_attention(q5, k5, v5, attn_bias=bias)  # (1, T_q, H_kv, H/H_kv, Dh)
    return out.view(q.shape)
