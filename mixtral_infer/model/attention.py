"""Attention over a flat batch, with the mask given as an xformers attention bias, computed
with torch's ``scaled_dot_product_attention``. This is the reference: ``fast.batched_attention``
batches single queries, ``fast.cuda_attention`` swaps CUDA kernels in.

* block-diagonal biases (prefill): one SDPA call per sequence, with that
  sequence's (q_len, kv_len) causal / sliding-window mask, never a dense mask
  over the whole batch; a sequence much longer than the window in tiles of
  queries, each over only the keys it can see (``window_tiles``);
* the padded-keys bias (decoding): each sequence's query against its own cache
  buffer; one batched call where every sequence has as many keys.

Grouped-query attention uses SDPA's ``enable_gqa``: K/V are never repeated. Single queries
on CPU are attended in float32 (``one_query_sdpa``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from mixtral_infer.model.xformers_bias import (
    AttentionBias,
    BlockDiagonalCausalWithOffsetPaddedKeysMask,
    BlockDiagonalMask,
    block_semantics,
)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: AttentionBias) -> torch.Tensor:
    """Attention of q ``(T_q, H, Dh)`` over k, v ``(T_k, H_kv, Dh)``; returns ``(T_q, H, Dh)``."""
    if isinstance(bias, BlockDiagonalCausalWithOffsetPaddedKeysMask):
        return _padded_keys_attention(q, k, v, bias)
    if isinstance(bias, BlockDiagonalMask):
        return _block_diagonal_attention(q, k, v, bias)
    raise NotImplementedError(f"no attention for bias type {type(bias).__name__}")


def local_causal_mask(q_len: int, kv_len: int, window: Optional[int], device: torch.device) -> torch.Tensor:
    """Boolean ``(q_len, kv_len)`` mask, aligned at the bottom right.

    Query i sits at key index ``i + kv_len - q_len`` and sees the keys from
    ``window - 1`` before itself (every earlier key without a window) up to itself.
    """
    shift = kv_len - q_len
    query = torch.arange(q_len, device=device)[:, None] + shift
    key = torch.arange(kv_len, device=device)[None, :]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    return allowed


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """SDPA on (T, H, Dh) layouts; returns (T_q, H, Dh). ``mask`` None: plain causal (square).

    The inputs get a batch dimension of 1: given 3-D tensors, SDPA on CPU takes its math path
    (the scores materialized, mask and all), where 4-D ones take its flash kernel.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, enable_gqa=True,
    )  # (1, H, T_q, Dh)  # fmt: skip
    return out[0].transpose(0, 1)


def _block_diagonal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: BlockDiagonalMask
) -> torch.Tensor:
    bottom_right, window = block_semantics(bias)
    return block_attention(q, k, v, blocks_of(bias), bottom_right, window, torch.empty_like(q))


def blocks_of(bias: BlockDiagonalMask) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Each block's ``((q_start, q_end), (k_start, k_end))`` in the flat queries and keys."""
    return list(zip(bias.q_seqinfo.intervals(), bias.k_seqinfo.intervals()))


QUERY_TILE = 256  # queries per SDPA call in a long sliding-window block (at least the window)


def window_tiles(q_len: int, kv_len: int, window: Optional[int]) -> list[tuple[int, int, int, int]]:
    """Tiles ``(q_from, q_to, k_from, k_to)`` of a bottom-right-aligned sliding-window block.

    A dense mask over the whole block costs ``q_len * kv_len`` scores, nearly all masked
    out when the block is much longer than the window. Each tile of ``t = max(window,
    QUERY_TILE)`` queries instead gets only the keys its queries can see: at most
    ``t + window - 1``. Query i sits at key index ``i + kv_len - q_len``, so a tile is
    itself bottom-right aligned and takes ``local_causal_mask`` as it is.

    Example, q_len = kv_len = 700, window 100 (t = 256)::

        [(0, 256, 0, 256), (256, 512, 157, 512), (512, 700, 413, 700)]
    """
    shift = kv_len - q_len
    tile = max(window or 0, QUERY_TILE)
    if window is None or q_len <= tile:
        return [(0, q_len, 0, kv_len)]
    return [
        (start, min(start + tile, q_len), max(0, start + shift - window + 1), min(start + tile, q_len) + shift)
        for start in range(0, q_len, tile)
    ]


def block_attention(
    q: torch.Tensor,  # (T_q, H, Dh)
    k: torch.Tensor,  # (T_k, H_kv, Dh)
    v: torch.Tensor,
    blocks: list[tuple[tuple[int, int], tuple[int, int]]],  # blocks_of(bias)
    bottom_right: bool,
    window: Optional[int],
    out: torch.Tensor,  # (T_q, H, Dh), its blocks' rows written
) -> torch.Tensor:
    """SDPA per block, each with its own causal (q_len, kv_len) mask; long sliding-window blocks in
    tiles of queries (``window_tiles``). Returns ``out``."""
    for (q_start, q_end), (k_start, k_end) in blocks:
        q_len, kv_len = q_end - q_start, k_end - k_start
        if q_len == 0:
            continue
        # A top-left causal block is the bottom-right one when the block is square.
        if not bottom_right and q_len != kv_len:
            raise NotImplementedError("top-left causal blocks must be square")
        for q_from, q_to, k_from, k_to in window_tiles(q_len, kv_len, window):
            square = q_to - q_from == k_to - k_from and (window is None or k_to - k_from <= window)
            # A square tile the window does not cut is plain causal: SDPA's own mask, none built.
            mask = None if square else local_causal_mask(q_to - q_from, k_to - k_from, window, q.device)
            out[q_start + q_from : q_start + q_to] = _sdpa(
                q[q_start + q_from : q_start + q_to], k[k_start + k_from : k_start + k_to],
                v[k_start + k_from : k_start + k_to], mask,
            )  # fmt: skip
    return out


def one_query_sdpa(
    q: torch.Tensor,  # (N, H, Dh): one query per row
    keys: torch.Tensor,  # (N, S, H_kv, Dh)
    values: torch.Tensor,  # (N, S, H_kv, Dh)
    mask: Optional[torch.Tensor] = None,  # (N, 1, 1, S), True where row n sees slot s; None: every slot
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of one query per row -> ``(N, H, Dh)``, in float32 on CPU.

    PyTorch's CPU attention kernel is slow for one bfloat16 query and fast for one float32 query,
    so 16-bit inputs on CPU are widened first (exactly: every bfloat16 and float16 value is a
    float32 value; the result is rounded back once). docs/performance.md has the figures.
    """
    dtype = q.dtype
    if q.device.type == "cpu":
        q, keys, values = q.float(), keys.float(), values.float()  # no copy when float32 already
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, enable_gqa=True
    )  # (N, H, 1, Dh)
    return out[:, :, 0, :].to(dtype)


def _padded_keys_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: BlockDiagonalCausalWithOffsetPaddedKeysMask
) -> torch.Tensor:
    """Decoding: each sequence's queries over its own padded block of keys, causal from the bottom
    right; one batched call when every sequence brings one query over as many keys."""
    q_seqlens = [end - start for start, end in bias.q_seqinfo.intervals()]
    lengths = bias.k_seqinfo.seqlen_py
    if any(n != 1 for n in q_seqlens) or min(lengths) != max(lengths):
        # Unused slots (they may hold anything, NaN included) are never read.
        return block_attention(q, k, v, blocks_of(bias), True, None, torch.empty_like(q))
    batch, padding, (n_kv_heads, head_dim) = len(q_seqlens), bias.k_seqinfo.padding, k.shape[1:]
    # Every sequence has the same number of keys: its block's first lengths[0] slots, in place.
    keys = k.view(batch, padding, n_kv_heads, head_dim)[:, : lengths[0]]  # (B, S, H_kv, Dh)
    values = v.view(batch, padding, n_kv_heads, head_dim)[:, : lengths[0]]
    return one_query_sdpa(q, keys, values)  # (B, H, Dh) == (T_q, H, Dh)
