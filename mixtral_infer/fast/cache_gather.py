"""The keys and values a prefill chunk attends to, gathered by index: the fast form of
``CacheView.interleave_kv`` (``FastAttention.cached_keys`` uses it on CUDA and for many sequences).

The reference loops over the sequences: a split, an ``unrotate`` and a cat each. Here three index
operations per layer build the same tensor, the indices made once per chunk for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from mixtral_infer.model.cache import CacheView, RotatingCacheInputMetadata

# Up to this many sequences the reference's loop (which copies each cache once) is kept on CPU; the
# gather copies twice but costs no Python per sequence (docs/performance.md, "The KV cache").
LOOP_MAX_SEQUENCES = 8


@dataclass
class KVGather:
    """Where each key of ``[cache_0 | chunk_0 | cache_1 | chunk_1 | ...]`` comes from.

    ``key[cache_dst] = flat_cache[cache_rows]`` and ``key[chunk_dst] = chunk``: three index
    operations per layer instead of a split, an unrotate and a cat per sequence.
    """

    cache_rows: torch.Tensor  # (N_c,) rows of the flat (B*S) buffer, each sequence's in position order
    cache_dst: torch.Tensor  # (N_c,) where they go in the key tensor (N_c: cached keys taking part)
    chunk_dst: torch.Tensor  # (T,) where the chunk's tokens go
    total: int  # rows of the key tensor: sum(min(seen_b, S) + T_b)


def kv_gather(chunk_lengths: List[int], seen_before: List[int], cache_size: int, device: torch.device) -> KVGather:
    """The index form of ``interleave_list(unrotated caches, chunks)`` over the sequences taking part.

    S = 3, chunk_lengths ``[2, 0, 1]``, seen ``[4, 9, 1]``: sequence 0 holds positions 1..3 in slots
    ``[1, 2, 0]`` (oldest first), sequence 2 position 0 in slot 0 (flat row 2 * 3 + 0 = 6)::

        key rows    0 1 2 | 3 4   | 5 | 6
        from        cache rows 1 2 0 | chunk 0 1 | cache row 6 | chunk 2
        cache_rows = [1, 2, 0, 6], cache_dst = [0, 1, 2, 5], chunk_dst = [3, 4, 6]
    """
    cache_rows: List[int] = []
    cache_dst: List[int] = []
    chunk_dst: List[int] = []
    offset = 0
    for b, (n, seen) in enumerate(zip(chunk_lengths, seen_before)):
        if n == 0:
            continue
        cached = min(seen, cache_size)
        oldest = seen % cache_size if seen >= cache_size else 0
        cache_rows.extend(b * cache_size + (oldest + j) % cache_size for j in range(cached))
        cache_dst.extend(range(offset, offset + cached))
        chunk_dst.extend(range(offset + cached, offset + cached + n))
        offset += cached + n

    def as_tensor(values: List[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return KVGather(as_tensor(cache_rows), as_tensor(cache_dst), as_tensor(chunk_dst), offset)


def gathered_kv(view: CacheView, xk: torch.Tensor, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``view.interleave_kv(xk, xv)``, by index where that is faster: on CUDA, and for more than
    ``LOOP_MAX_SEQUENCES`` sequences; by the reference's loop otherwise."""
    metadata = view.metadata
    active = sum(1 for n in metadata.chunk_lengths if n > 0)
    if metadata.nothing_cached or not (xk.is_cuda or active > LOOP_MAX_SEQUENCES):
        return view.interleave_kv(xk, xv)
    return gather_kv(view, xk), gather_kv(view, xv, values=True)


def gather_kv(view: CacheView, chunk: torch.Tensor, values: bool = False) -> torch.Tensor:
    """``interleave_kv``'s keys (or values) ``(sum(cached + T_b), H_kv, Dh)`` by three index
    operations (``KVGather``): the same tensor, with no Python loop over the sequences."""
    gather = metadata_gather(view.metadata)
    buffer = view.cache_v if values else view.cache_k
    flat = buffer.view(-1, *buffer.shape[2:])  # (B_max*S, H_kv, Dh)
    out = chunk.new_empty(gather.total, *chunk.shape[1:])  # (sum(cached + T_b), H_kv, Dh)
    out.index_copy_(0, gather.cache_dst, flat.index_select(0, gather.cache_rows))
    out.index_copy_(0, gather.chunk_dst, chunk)
    return out


def metadata_gather(metadata: RotatingCacheInputMetadata) -> KVGather:
    """``kv_gather`` of a chunk's metadata, made once for all its layers (kept on the metadata)."""
    gather = metadata.__dict__.get("_kv_gather")
    if gather is None:
        gather = metadata.__dict__["_kv_gather"] = kv_gather(
            metadata.chunk_lengths, metadata.seen_before, metadata.cache_size, metadata.positions.device
        )
    return gather
