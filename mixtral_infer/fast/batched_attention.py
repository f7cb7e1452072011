"""Attention with the single queries of a pass in one batched call: the fast form of
``model.attention.attention`` (``FastAttention.kernel`` on CPU).

Decoding brings one query per sequence; the reference attends sequence by sequence where their
key counts differ, one SDPA call each. Here every single query of a pass attends in one call over
its own keys, gathered and padded to the longest (``single_query_gather``), the padding masked.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from mixtral_infer.model.attention import attention, block_attention, blocks_of, one_query_sdpa
from mixtral_infer.model.xformers_bias import (
    AttentionBias,
    BlockDiagonalCausalWithOffsetPaddedKeysMask,
    BlockDiagonalMask,
    block_semantics,
)


def batched_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: AttentionBias) -> torch.Tensor:
    """``attention(q, k, v, bias)`` ``(T_q, H, Dh)``, the single queries in one call."""
    if isinstance(bias, BlockDiagonalCausalWithOffsetPaddedKeysMask):
        q_seqlens = [end - start for start, end in bias.q_seqinfo.intervals()]
        rows = [b for b, n in enumerate(q_seqlens) if n == 1]
        lengths, padding = bias.k_seqinfo.seqlen_py, bias.k_seqinfo.padding
        if max(q_seqlens, default=0) > 1 or (len(rows) == len(q_seqlens) and len({lengths[b] for b in rows}) == 1):
            return attention(q, k, v, bias)
        # Sequences sitting out, or of unequal lengths: each one's own keys gathered.
        return single_query_attention(q, k, v, [(b * padding, b * padding + lengths[b]) for b in rows], None)
    if not isinstance(bias, BlockDiagonalMask):
        return attention(q, k, v, bias)
    bottom_right, window = block_semantics(bias)
    blocks = blocks_of(bias)
    singles = [(q_start, k_start, k_end) for (q_start, q_end), (k_start, k_end) in blocks if q_end - q_start == 1]
    if len(singles) < 2:
        return attention(q, k, v, bias)
    # A single query is the last position of its block, whether the block is aligned at the
    # bottom right or (square, 1 x 1) at the top left: one batched call for all of them.
    out = torch.empty_like(q)
    rows = torch.tensor([q_start for q_start, _, _ in singles], device=q.device)
    out[rows] = single_query_attention(q[rows], k, v, [(k_start, k_end) for _, k_start, k_end in singles], window)
    others = [block for block in blocks if block[0][1] - block[0][0] != 1]
    return block_attention(q, k, v, others, bottom_right, window, out)


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
    """The rows of k that ``single_query_attention`` reads ``(N*L,)``, the mask of the padding
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


def single_query_attention(
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
