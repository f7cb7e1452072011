"""Attention over a flat batch, with the mask given as an xformers attention bias, computed
with torch's ``scaled_dot_product_attention``. This is the reference; ``fast.cuda_attention``
swaps CUDA kernels in.

* block-diagonal biases (prefill): one SDPA call per sequence, with that
  sequence's (q_len, kv_len) causal / sliding-window mask, never a dense mask
  over the whole batch; a sequence much longer than the window in tiles of
  queries, each over only the keys it can see (``window_tiles``); the sequences
  that bring a single query (one-token prompts) together in one batched call
  (``single_query_keys``);
* the padded-keys bias (decoding): one batched call, each sequence's single
  query against its own cache buffer, with a per-sequence key length.

Grouped-query attention uses SDPA's ``enable_gqa``: K/V are never repeated. Single queries
on CPU are attended in float32 (``one_query_sdpa``).
"""

from __future__ import annotations

import functools
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
    return _per_block_attention(q, k, v, bias, bottom_right, window)


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


def _per_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias,
    bottom_right: bool,
    window: Optional[int],
) -> torch.Tensor:
    """SDPA per block of the bias, each with its own causal (q_len, kv_len) mask; long
    sliding-window blocks in tiles of queries (``window_tiles``)."""
    out = torch.empty_like(q)
    blocks = list(zip(bias.q_seqinfo.intervals(), bias.k_seqinfo.intervals()))
    singles = [(q_start, k_start, k_end) for (q_start, q_end), (k_start, k_end) in blocks if q_end - q_start == 1]
    if len(singles) > 1:
        # A single query is the last position of its block, whether the block is aligned at the
        # bottom right or (square, 1 x 1) at the top left: one batched call for all of them.
        rows = torch.tensor([q_start for q_start, _, _ in singles], device=q.device)
        out[rows] = _single_query_attention(q[rows], k, v, [(k_start, k_end) for _, k_start, k_end in singles], window)
        blocks = [block for block in blocks if block[0][1] - block[0][0] != 1]
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


def single_query_keys(key_ranges: list[tuple[int, int]], window: Optional[int]) -> tuple[list[int], list[int]]:
    """First key row and key count each single query sees, its query being its block's last key.

    Blocks ``[0, 5)`` and ``[5, 6)`` and ``[6, 40)`` with a window of 8: the first query sees keys
    0..4, the second key 5 alone, the third the last 8 keys of its block, 32..39::

        starts = [0, 5, 32], lengths = [5, 1, 8]
    """
    starts = [max(start, end - window) if window is not None else start for start, end in key_ranges]
    return starts, [end - first for first, (_, end) in zip(starts, key_ranges)]


@functools.lru_cache(maxsize=16)
def single_query_gather(
    key_ranges: tuple[tuple[int, int], ...], window: Optional[int], device: torch.device
) -> tuple[torch.Tensor, Optional[torch.Tensor], int]:
    """The rows of k that ``_single_query_attention`` reads ``(N*L,)``, the mask of the padding
    ``(N, 1, 1, L)`` (None when every query sees L keys), and L, the most keys a query sees.

    Every layer of a pass asks for the same ones, so they are made once (cached; never written;
    made as normal tensors even under ``inference_mode``, so a later pass with gradients can use them).
    Blocks ``[0, 3)`` and ``[3, 4)``: query 0 reads rows 0 1 2, query 1 reads row 3 then repeats it::

        index = [0, 1, 2, 3, 3, 3], mask = [[T, T, T], [T, F, F]], L = 3
    """
    starts, lengths = single_query_keys(list(key_ranges), window)
    longest = max(lengths)
    with torch.inference_mode(False):
        offsets = torch.arange(longest, device=device)  # (L,)
        start, length = torch.tensor([starts, lengths], device=device)[:, :, None]  # (N, 1) each
        index = (start + torch.minimum(offsets, length - 1)).view(-1)  # (N*L,)
        mask = (offsets < length)[:, None, None, :] if min(lengths) < longest else None  # (N, 1, 1, L)
    return index, mask, longest


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


def _single_query_attention(
    q: torch.Tensor,  # (N, H, Dh): one query per block
    k: torch.Tensor,  # (T_k, H_kv, Dh)
    v: torch.Tensor,
    key_ranges: list[tuple[int, int]],  # each block's [k_start, k_end) in k
    window: Optional[int],
) -> torch.Tensor:
    """One batched call: query n against the keys it sees (``single_query_keys``), padded to the
    longest. A padded slot repeats its block's last key and is masked out, so it reads only that
    block's own keys (a NaN elsewhere in the batch cannot leak in)."""
    index, mask, longest = single_query_gather(tuple(key_ranges), window, k.device)
    shape = (len(key_ranges), longest, *k.shape[1:])  # (N, L, H_kv, Dh)
    return one_query_sdpa(q, k.index_select(0, index).view(shape), v.index_select(0, index).view(shape), mask)


def _padded_keys_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: BlockDiagonalCausalWithOffsetPaddedKeysMask
) -> torch.Tensor:
    """Decoding: at most one query per sequence, each over its own padded block of keys."""
    q_seqlens = [end - start for start, end in bias.q_seqinfo.intervals()]
    kv_seqlens = bias.k_seqinfo.seqlen_py
    padding = bias.k_seqinfo.padding
    if max(q_seqlens, default=0) > 1:
        # Several queries per sequence: causal from the bottom right within each used block.
        return _per_block_attention(q, k, v, bias, bottom_right=True, window=None)
    batch = len(q_seqlens)
    rows = [b for b, n in enumerate(q_seqlens) if n == 1]
    lengths = [kv_seqlens[b] for b in rows]
    if len(rows) != batch or min(lengths) != max(lengths):
        # Sequences sitting out, or of unequal lengths: gather each one's own keys. Unused
        # slots (they may hold anything, NaN included) are never read.
        return _single_query_attention(q, k, v, [(b * padding, b * padding + kv_seqlens[b]) for b in rows], None)
    n_kv_heads, head_dim = k.shape[1:]
    # Every sequence has the same number of keys: its block's first lengths[0] slots, in place.
    keys = k.view(batch, padding, n_kv_heads, head_dim)[:, : lengths[0]]  # (B, S, H_kv, Dh)
    values = v.view(batch, padding, n_kv_heads, head_dim)[:, : lengths[0]]
    return one_query_sdpa(q, keys, values)  # (B, H, Dh) == (T_q, H, Dh)
