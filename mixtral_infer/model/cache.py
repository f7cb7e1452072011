"""The rotating (rolling) buffer KV cache used with sliding-window attention.

With a sliding window of W tokens, position ``p`` only ever attends to positions
``p-W+1 .. p``. So a sequence needs at most W keys/values in its cache, and the
keys/values of position ``i`` are stored in slot ``i % W``: the buffer "rotates".

Worked example (from the article "图解Mixtral 8 * 7b推理优化原理与源码实现"), W = 3, one prompt
of 10 tokens prefilled in chunks of 5. Only the last W tokens of a chunk are written::

    chunk 0, positions 0..4: writes 2 -> slot 2, 3 -> slot 0, 4 -> slot 1
             cache slots hold positions [3, 4, 2]
    chunk 1, positions 5..9: writes 7 -> slot 1, 8 -> slot 2, 9 -> slot 0
             cache slots hold positions [9, 7, 8]

To attend, the cache is put back in position order by ``unrotate``: with 10
tokens seen, the oldest one lives in slot ``10 % 3 = 1``, so the order is slots
``[1, 2, 0]`` = positions ``[7, 8, 9]``.

The whole batch is one flat tensor of ``sum(chunk_lengths)`` tokens. A chunk of a
later prefill attends to ``[unrotated cache of seq 0 | chunk of seq 0 | unrotated
cache of seq 1 | chunk of seq 1 | ...]``: ``interleave_list`` builds that order.

``RotatingBufferCache`` owns the buffers and counts the tokens each sequence has seen;
``RotatingCacheInputMetadata`` says, for one chunk, which tokens go where and which attention
bias to use; ``CacheView`` is one layer's window onto both. Nothing here knows about weights.
Shapes: B sequences (``B_max`` rows in the buffers), S slots per sequence, T tokens in the chunk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, TypeVar

import torch

from mixtral_infer.errors import GenerationError, as_int
from mixtral_infer.model.xformers_bias import (
    AttentionBias,
    BlockDiagonalCausalMask,
    BlockDiagonalCausalWithOffsetPaddedKeysMask,
    BlockDiagonalMask,
)

T = TypeVar("T")



def interleave_list(first: Sequence[T], second: Sequence[T]) -> List[T]:
    """``[a0, b0, a1, b1, ...]`` from ``[a0, a1, ...]`` and ``[b0, b1, ...]``.

    >>> interleave_list(["cache0", "cache1"], ["chunk0", "chunk1"])
    ['cache0', 'chunk0', 'cache1', 'chunk1']
    """
    if len(first) != len(second):
        raise ValueError(f"interleave_list needs lists of equal length, got {len(first)} and {len(second)}")
    return [item for pair in zip(first, second) for item in pair]


def unrotate(buffer: torch.Tensor, seqlen: int) -> torch.Tensor:
    """One sequence's cache slots in position order.

    ``buffer`` is ``(S, ...)`` with ``S`` slots where position ``i`` lives in slot
    ``i % S``; ``seqlen`` is how many tokens the sequence has seen. Returns the
    last ``min(seqlen, S)`` positions, oldest first.

    W = 4, 10 tokens seen, slots hold positions ``[8, 9, 6, 7]``: the oldest is
    in slot ``10 % 4 = 2``, so the result is ``[6, 7, 8, 9]``.
    """
    size = buffer.shape[0]
    if seqlen < size:
        return buffer[:seqlen]
    oldest = seqlen % size
    if oldest == 0:
        return buffer
    return torch.cat([buffer[oldest:], buffer[:oldest]], dim=0)


@dataclass
class RotatingCacheInputMetadata:
    """What one forward pass over a chunk needs to read and write the cache.

    Worked example: chunk_lengths ``[5, 7, 2]`` arriving when the sequences have seen
    ``[0, 1, 3]`` tokens, W = 3::

        positions       = [0 1 2 3 4 | 1 2 3 4 5 6 7 | 3 4]
        to_cache_mask   = [F F T T T | F F F F T T T | T T]   (last W of each)
        to_cache_rows   = [2 3 4 | 9 10 11 | 12 13]
        cache_positions = [2 0 1 | 5 3 4 | 6 7]              (b * W + p % W)
    """

    positions: torch.Tensor  # (T,) absolute position of each token in its sequence
    to_cache_mask: torch.Tensor  # (T,) bool: the token is among its sequence's last `cache_size` in this chunk
    to_cache_rows: torch.Tensor  # (N_w,) where to_cache_mask is true, as indices (N_w: tokens this chunk writes)
    cache_positions: torch.Tensor  # (N_w,) flat slot index b * cache_size + p % cache_size of those rows
    decoding: bool  # True: one new token per sequence, attending to its whole buffer; False: [unrotated cache | chunk]
    mask: Optional[AttentionBias]  # None when the pass attends in parts
    chunk_lengths: List[int]  # (B,) tokens of each sequence in this chunk; 0 for a sequence that sits it out
    seen_before: List[int]  # (B,) tokens each sequence had seen before this chunk
    cache_size: int  # S, slots per sequence
    # Set when the pass attends in parts (``split_mixed``): each part's rows of the flat batch
    # (T_part,) and its metadata (the other sequences sit it out).
    parts: Optional[List[Tuple[torch.Tensor, "RotatingCacheInputMetadata"]]] = None
    # With slack (SlackSlots): the chunk's tokens whose positions it pushes out itself (a chunk longer
    # than S), its last ones, (N_s,) rows of the flat chunk, and their flat slack slots (N_s,).
    slack_writes: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def nothing_cached(self) -> bool:
        """No sequence taking part has anything cached yet: attend within the chunk only."""
        return all(seen == 0 for seen, n in zip(self.seen_before, self.chunk_lengths) if n > 0)


def _causal_mask(q_seqlens: List[int], window: Optional[int], device: torch.device) -> AttentionBias:
    mask = BlockDiagonalCausalMask.from_seqlens(q_seqlens, device=device)
    return mask.make_local_attention(window) if window is not None else mask


def _bottom_right_mask(
    q_seqlens: List[int], kv_seqlens: List[int], window: Optional[int], device: torch.device
) -> AttentionBias:
    mask = BlockDiagonalMask.from_seqlens(q_seqlens, kv_seqlens, device=device)
    if window is not None:
        return mask.make_local_attention_from_bottomright(window)
    return mask.make_causal_from_bottomright()


def causal_attention_bias(seqlens: List[int], window: Optional[int], device: torch.device) -> AttentionBias:
    """Plain causal (sliding-window) attention within each sequence, no cache."""
    return _causal_mask([n for n in seqlens if n > 0], window, device)


def split_mixed(chunk_lengths: List[int], device: torch.device) -> Optional[Tuple[List[int], List[int]]]:
    """The chunk lengths of the two parts of a mixed pass, or None when it attends in one.

    A serving step feeds one token to some sequences and a prompt chunk to others. Off CUDA it
    attends in two parts, each as its own kind of pass: the one-token sequences over their buffers
    as in decoding, the chunks over ``[cache | chunk]``; no decoding sequence's cache is copied
    into the ``[cache | chunk]`` order. CUDA's ragged kernels take the whole batch in one call.

    ``[1, 0, 5, 1]`` -> ``([1, 0, 0, 1], [0, 0, 5, 0])``; ``[1, 1]`` and ``[4, 2]`` -> None.
    """
    if device.type == "cuda":
        return None
    ones = [n if n == 1 else 0 for n in chunk_lengths]
    longer = [n if n > 1 else 0 for n in chunk_lengths]
    if not any(ones) or not any(longer):
        return None
    return ones, longer


def build_input_metadata(
    chunk_lengths: List[int],
    seen_before: List[int],
    cache_size: int,
    sliding_window: Optional[int],
    device: torch.device,
    split: bool = True,
) -> RotatingCacheInputMetadata:
    """Metadata for a chunk: pure function of the lengths, so it is easy to test.

    ``split``: a pass that mixes one-token sequences with longer chunks attends in parts (``split_mixed``).
    """
    if len(chunk_lengths) != len(seen_before):
        raise GenerationError(f"got {len(chunk_lengths)} sequence lengths for a cache holding {len(seen_before)} sequences")
    if any(n < 0 for n in chunk_lengths):
        raise ValueError(f"sequence lengths must be >= 0, got {chunk_lengths}")

    positions: List[int] = []
    to_cache: List[bool] = []
    cache_positions: List[int] = []
    for b, (n, seen) in enumerate(zip(chunk_lengths, seen_before)):
        first_cached = max(n - cache_size, 0)  # only the last `cache_size` tokens are written
        positions.extend(range(seen, seen + n))
        to_cache.extend(i >= first_cached for i in range(n))
        cache_positions.extend(b * cache_size + p % cache_size for p in range(seen + first_cached, seen + n))

    active = [b for b, n in enumerate(chunk_lengths) if n > 0]
    q_seqlens = [chunk_lengths[b] for b in active]
    cached_before = [min(seen_before[b], cache_size) for b in active]
    decoding = all(n <= 1 for n in chunk_lengths) and any(c > 0 for c in cached_before)
    parts = None
    halves = split_mixed(chunk_lengths, device) if split else None
    mask: Optional[AttentionBias] = None
    if halves is not None:  # each part has its own mask
        starts = [0, *itertools.accumulate(chunk_lengths)]  # sequence b's tokens are starts[b] : starts[b + 1]
        parts = []
        for lengths in halves:
            rows = [t for b, n in enumerate(lengths) if n for t in range(starts[b], starts[b + 1])]
            part = build_input_metadata(lengths, seen_before, cache_size, sliding_window, device, split=False)
            parts.append((torch.tensor(rows, dtype=torch.long, device=device), part))
    elif decoding:
        # Every sequence adds at most one token and the query attends to the whole
        # (rotated) buffer of its sequence, whose order does not matter to attention.
        mask = BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
            q_seqlen=list(chunk_lengths),
            kv_padding=cache_size,
            kv_seqlen=[min(seen + n, cache_size) for seen, n in zip(seen_before, chunk_lengths)],
            device=device,
        )
    elif all(c == 0 for c in cached_before):
        mask = _causal_mask(q_seqlens, sliding_window, device)
    else:
        kv_seqlens = [n + c for n, c in zip(q_seqlens, cached_before)]
        mask = _bottom_right_mask(q_seqlens, kv_seqlens, sliding_window, device)

    return RotatingCacheInputMetadata(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        to_cache_mask=torch.tensor(to_cache, dtype=torch.bool, device=device),
        to_cache_rows=torch.tensor([i for i, cached in enumerate(to_cache) if cached], dtype=torch.long, device=device),
        cache_positions=torch.tensor(cache_positions, dtype=torch.long, device=device),
        decoding=decoding,
        mask=mask,
        chunk_lengths=list(chunk_lengths),
        seen_before=list(seen_before),
        cache_size=cache_size,
        parts=parts,
    )


def slack_writes(
    chunk_lengths: Sequence[int], seen_before: Sequence[int], cache_size: int, slack: int, device: torch.device
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Where a chunk writes, into a row's ``slack`` slack slots (``SlackSlots``), the positions it pushes out
    of a buffer of ``cache_size`` slots itself: a chunk longer than S writes only its last S tokens to
    the buffer, so positions ``seen .. seen + n - S - 1`` are never there; the last ``slack`` of them go
    to slack slot ``p % slack``. ``(rows of the flat chunk, flat slack slots b * slack + p % slack)``, or
    None when no chunk is longer than S.

    Chunks ``[6, 2]`` after ``[0, 5]`` tokens, S = 4, slack 3: row 0 pushes out positions 0 and 1
    (chunk rows 0, 1; slack slots 0, 1); row 1's positions it pushes out (1, 2) were in its buffer.

    >>> [t.tolist() for t in slack_writes([6, 2], [0, 5], 4, 3, torch.device("cpu"))]
    [[0, 1], [0, 1]]
    """
    rows: List[int] = []
    slots: List[int] = []
    start = 0
    for b, (n, seen) in enumerate(zip(chunk_lengths, seen_before)):
        end = seen + n - cache_size  # positions below `end` are pushed out once the chunk is written
        for p in range(max(seen, end - slack), end):
            rows.append(start + p - seen)
            slots.append(b * slack + p % slack)
        start += n
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(slots, dtype=torch.long, device=device)


class CacheView:
    """One layer's keys/values buffers seen through one chunk's metadata; with slack (``SlackSlots``), the
    layer's slack slots ``(B_max, slack, H_kv, Dh)`` too, which ``update`` writes (``slack_writes``)."""

    def __init__(
        self,
        cache_k: torch.Tensor,  # (B_max, S, H_kv, Dh)
        cache_v: torch.Tensor,  # (B_max, S, H_kv, Dh)
        metadata: RotatingCacheInputMetadata,
        slack_k: Optional[torch.Tensor] = None,  # (B_max, slack, H_kv, Dh)
        slack_v: Optional[torch.Tensor] = None,
    ):
        self.cache_k = cache_k
        self.cache_v = cache_v
        self.metadata = metadata
        self.slack_k, self.slack_v = slack_k, slack_v

    @property
    def batch_size(self) -> int:
        return len(self.metadata.chunk_lengths)

    @property
    def decoding(self) -> bool:
        return self.metadata.decoding

    @property
    def parts(self) -> Optional[List[Tuple[torch.Tensor, "CacheView"]]]:
        """The parts a mixed pass attends in (``split_mixed``): rows of the flat batch ``(T_part,)`` and a view each."""
        if self.metadata.parts is None:
            return None
        return [
            (rows, CacheView(self.cache_k, self.cache_v, part, self.slack_k, self.slack_v)) for rows, part in self.metadata.parts
        ]

    @property
    def mask(self) -> Optional[AttentionBias]:
        return self.metadata.mask  # None when the pass attends in parts

    def update(self, xk: torch.Tensor, xv: torch.Tensor) -> None:
        """Write the chunk's keys/values (T, H_kv, Dh) into their slots (only the last S of each sequence)."""
        n_kv_heads, head_dim = self.cache_k.shape[-2:]
        flat_k = self.cache_k.view(-1, n_kv_heads, head_dim)  # (B_max*S, H_kv, Dh)
        flat_v = self.cache_v.view(-1, n_kv_heads, head_dim)
        rows = self.metadata.to_cache_rows  # an index, not a boolean mask: no device sync
        flat_k.index_copy_(0, self.metadata.cache_positions, xk.index_select(0, rows))
        flat_v.index_copy_(0, self.metadata.cache_positions, xv.index_select(0, rows))
        if self.slack_k is not None and self.metadata.slack_writes is not None:
            rows, slots = self.metadata.slack_writes
            self.slack_k.view(-1, n_kv_heads, head_dim).index_copy_(0, slots, xk.index_select(0, rows))
            self.slack_v.view(-1, n_kv_heads, head_dim).index_copy_(0, slots, xv.index_select(0, rows))

    def interleave_kv(self, xk: torch.Tensor, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values a prefill chunk attends to, before it is written: ``[cache_0 | chunk_0 | cache_1 |
        chunk_1 | ...]`` over the sequences taking part, each cache unrotated to position order,
        ``(sum(min(seen_b, S) + T_b), H_kv, Dh)``."""
        if self.metadata.nothing_cached:
            return xk, xv
        lengths, seen = self.metadata.chunk_lengths, self.metadata.seen_before
        active = [b for b, n in enumerate(lengths) if n > 0]
        chunk_k = torch.split(xk, [lengths[b] for b in active])
        chunk_v = torch.split(xv, [lengths[b] for b in active])
        cached_k = [unrotate(self.cache_k[b], seen[b]) for b in active]
        cached_v = [unrotate(self.cache_v[b], seen[b]) for b in active]
        key = torch.cat(interleave_list(cached_k, chunk_k), dim=0)
        value = torch.cat(interleave_list(cached_v, chunk_v), dim=0)
        return key, value

    @property
    def key(self) -> torch.Tensor:
        """The buffers of the sequences in use, flat: (B*S, H_kv, Dh), for decoding."""
        return self.cache_k[: self.batch_size].flatten(0, 1)

    @property
    def value(self) -> torch.Tensor:
        return self.cache_v[: self.batch_size].flatten(0, 1)


@dataclass(frozen=True)
class BufferKind:
    """What a layer's buffer is: ``size`` slots per sequence, read under a ``window`` (None: full attention).

    Layers of one kind share one buffer tensor and one chunk's metadata (``RotatingBufferCache``)."""

    size: int  # S
    window: Optional[int]  # W, None for a full-attention layer


def layer_cache_sizes(windows: Sequence[Optional[int]], max_seqlen: Optional[int]) -> List[int]:
    """Slots per sequence of each layer's buffer: ``min(W, max_seqlen)`` for a layer with a window W
    (W when ``max_seqlen`` is None), ``max_seqlen`` for a full-attention layer, which keeps every position.

    A windowed layer stores position p in slot ``p % W`` and overwrites what fell out of its window;
    a full-attention layer of ``max_seqlen`` slots stores p in slot p and never overwrites. Each
    layer's buffer is sized on its own, so the cache's memory is the sum over the layers.

    Worked example: the article's W = 3 and one full-attention layer before it, ``windows [None, 3]``,
    one prompt of 10 tokens prefilled in chunks of 5 (``max_seqlen`` 10): sizes ``[10, 3]``::

        layer 0 (10 slots, full):   chunk 0 writes 0..4 -> slots 0..4; chunk 1 writes 5..9 -> slots 5..9
                                    chunk 1 attends to [cached 0..4 | chunk 5..9], causal
        layer 1 (3 slots, W = 3):   chunk 0 writes 2 -> slot 2, 3 -> slot 0, 4 -> slot 1
                                    chunk 1 attends to [cached 2, 3, 4 | chunk 5..9], window 3,
                                    then writes 7 -> slot 1, 8 -> slot 2, 9 -> slot 0

    >>> layer_cache_sizes([None, 3], 10), layer_cache_sizes([None, 3, 3, 3], 2), layer_cache_sizes([4, 4], None)
    ([10, 3], [2, 2, 2, 2], [4, 4])
    """
    if max_seqlen is None and any(window is None for window in windows):
        raise GenerationError("a model with full-attention layers needs max_seqlen to size its cache")
    return [
        max(window if max_seqlen is None else max_seqlen if window is None else min(window, max_seqlen), 1)
        for window in windows
    ]


def copied_slots(length: int, slots: int) -> Optional[slice]:
    """The slots of a buffer of ``slots`` slots that hold the state of a sequence's first ``length``
    tokens: ``0 .. length - 1`` while it fits, every slot (None) once it has wrapped.

    >>> copied_slots(3, 10), copied_slots(12, 10)
    (slice(0, 3, None), None)
    """
    return slice(0, length) if length <= slots else None


class RotatingBufferCache:
    """Each layer's K and V buffers ``(max_batch_size, S_layer, n_kv_heads, head_dim)``.

    ``cache_size`` is one size for every layer or a list of one per layer (``layer_cache_sizes``: a
    windowed layer's window, a full-attention layer's longest sequence; nothing is evicted from the
    latter); ``sliding_window`` likewise one window or one per layer (None: full attention). The
    layers of one kind (``BufferKind``: size and window) share one ``(L_kind, B_max, S, H_kv, Dh)``
    tensor and one chunk's metadata (``get_input_metadata``). ``tokens_seen``: the tokens each sequence
    has seen (empty until ``start_sequences``)."""

    def __init__(
        self,
        n_layers: int,
        max_batch_size: int,
        cache_size: int | Sequence[int],
        n_kv_heads: int,
        head_dim: int,
        sliding_window: Optional[int] | Sequence[Optional[int]] = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        sizes = list(cache_size) if isinstance(cache_size, (list, tuple)) else [cache_size] * n_layers
        windows = list(sliding_window) if isinstance(sliding_window, (list, tuple)) else [sliding_window] * n_layers
        if len(sizes) != n_layers or len(windows) != n_layers:
            raise ValueError(f"{len(sizes)} cache sizes and {len(windows)} windows for {n_layers} layers")
        for size, window in zip(sizes, windows):
            if size < 1:
                raise ValueError(f"cache_size must be >= 1, got {size}")
            if window is not None and size > window:
                raise ValueError(f"cache_size {size} is larger than the sliding window {window}")
        self.layer_kinds = [BufferKind(size, window) for size, window in zip(sizes, windows)]
        self.kinds: List[BufferKind] = list(dict.fromkeys(self.layer_kinds))  # distinct, in layer order
        self.kind_of = [self.kinds.index(kind) for kind in self.layer_kinds]  # (L,) each layer's kind
        # Each layer's place in its kind's tensor.
        self._place = [self.kind_of[:layer].count(self.kind_of[layer]) for layer in range(n_layers)]
        self.max_batch_size = max_batch_size
        # Zeros, not empty: no result depends on unused slots, but zeros keep them finite.
        self.kind_k: List[torch.Tensor] = []  # per kind: (L_kind, B_max, S, H_kv, Dh)
        self.kind_v: List[torch.Tensor] = []
        for index, kind in enumerate(self.kinds):
            shape = (self.kind_of.count(index), max_batch_size, kind.size, n_kv_heads, head_dim)
            self.kind_k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.kind_v.append(torch.zeros(shape, dtype=dtype, device=device))
        self.tokens_seen: List[int] = []
        # A prompt chunk cut short between layers leaves early layers' slots overwritten that, once the
        # window wrapped, later positions still needed: refused until the sequences start again.
        self.damaged = False
        self._views: Optional[tuple] = None  # (kind_k, kind_v, their layers' views): layer_keys
        self.slack: Optional["SlackSlots"] = None  # set by SlackSlots: the passes write into its slots too

    # One buffer for the whole cache, where every layer is of one kind (the published Mistral 7B
    # and Mixtral 8x7B, every model with one window): ``(L, B_max, S, H_kv, Dh)``.
    @property
    def cache_k(self) -> torch.Tensor:
        return self.kind_k[self._uniform("cache_k")]

    @cache_k.setter
    def cache_k(self, value: torch.Tensor) -> None:
        self.kind_k[self._uniform("cache_k")] = value

    @property
    def cache_v(self) -> torch.Tensor:
        return self.kind_v[self._uniform("cache_v")]

    @cache_v.setter
    def cache_v(self, value: torch.Tensor) -> None:
        self.kind_v[self._uniform("cache_v")] = value

    @property
    def cache_size(self) -> int:
        """S, the slots per sequence of every layer (a cache with layers of one size)."""
        return self.kinds[self._uniform("cache_size")].size

    @property
    def sliding_window(self) -> Optional[int]:
        """The window of every layer (a cache with layers of one kind)."""
        return self.kinds[self._uniform("sliding_window")].window

    def _uniform(self, name: str) -> int:
        if len(self.kinds) != 1:
            sizes = sorted({kind.size for kind in self.kinds})
            raise GenerationError(f"cache.{name}: this cache's layers are of {len(self.kinds)} kinds ({sizes} slots): "
                                  "read cache.layer_sizes, cache.layer_windows, cache.layer_keys or cache.kind_k")  # fmt: skip
        return 0

    @property
    def layer_sizes(self) -> List[int]:
        """(L,) each layer's slots per sequence."""
        return [kind.size for kind in self.layer_kinds]

    @property
    def layer_windows(self) -> List[Optional[int]]:
        """(L,) each layer's window, None for full attention."""
        return [kind.window for kind in self.layer_kinds]

    @property
    def device(self) -> torch.device:
        return self.kind_k[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.kind_k[0].dtype

    @property
    def n_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def n_kv_heads(self) -> int:
        return self.kind_k[0].shape[3]

    @property
    def head_dim(self) -> int:
        return self.kind_k[0].shape[4]

    @property
    def buffers(self) -> List[torch.Tensor]:
        """Every buffer tensor, keys then values of each kind: for operations on whole rows."""
        return [*self.kind_k, *self.kind_v]

    def nbytes(self) -> int:
        """The keys' and values' bytes: the sum over the layers of their own buffers."""
        return sum(buffer.nbytes for buffer in self.buffers)

    def clear_row(self, row: int) -> None:
        """Zero row ``row`` of every layer's buffers."""
        for buffer in self.buffers:
            buffer[:, row] = 0

    def copy_row(self, source: int, target: int, length: Optional[int] = None) -> None:
        """Copy row ``source``'s slots into row ``target``: every slot, or with ``length`` those holding
        positions ``0 .. length - 1`` in each layer (``copied_slots`` of the layer's size)."""
        for kind, keys, values in zip(self.kinds, self.kind_k, self.kind_v):
            part = None if length is None else copied_slots(length, kind.size)
            part = slice(None) if part is None else part
            keys[:, target, part] = keys[:, source, part]
            values[:, target, part] = values[:, source, part]

    def start_sequences(self, batch_size: int) -> None:
        """Hold ``batch_size`` new sequences, none of whose tokens are seen yet (the buffers are reused as they are)."""
        if as_int(batch_size) is None or not 1 <= batch_size <= self.max_batch_size:
            raise GenerationError(f"start_sequences({batch_size!r}): a cache of max_batch_size={self.max_batch_size} "
                                  f"holds 1 to {self.max_batch_size} sequences")  # fmt: skip
        self.tokens_seen = [0] * as_int(batch_size)
        self.damaged = False

    def get_input_metadata(self, chunk_lengths: List[int]) -> List[RotatingCacheInputMetadata]:
        """A chunk's metadata for each kind of layer (``kinds``): positions are the same in all,
        slots and masks are the kind's."""
        if not self.tokens_seen:
            self.start_sequences(len(chunk_lengths))
        metadata = [
            build_input_metadata(chunk_lengths, self.tokens_seen, kind.size, kind.window, self.device)
            for kind in self.kinds
        ]
        if self.slack is not None:  # the positions a chunk pushes out itself, into the slack slots
            for index, kind in enumerate(self.kinds):
                if self.slack.keys[index] is None:
                    continue
                for part in [metadata[index]] + [part for _, part in metadata[index].parts or []]:
                    part.slack_writes = slack_writes(
                        part.chunk_lengths, part.seen_before, kind.size, self.slack.slack, self.device
                    )
        return metadata

    @property
    def layer_keys(self) -> Tuple[torch.Tensor, ...]:
        """Each layer's key buffer ``(B_max, S_layer, H_kv, Dh)``, views of its kind's tensor, the same
        objects at every call: what a compiled step takes and writes in place."""
        return self._layer_views()[0]

    @property
    def layer_values(self) -> Tuple[torch.Tensor, ...]:
        """Each layer's value buffer, as ``layer_keys``."""
        return self._layer_views()[1]

    def _layer_views(self) -> Tuple[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]:
        held = self._views
        fresh = held is not None and all(a is b for a, b in zip(held[0] + held[1], self.kind_k + self.kind_v))
        if not fresh:  # made anew for new buffers
            keys = tuple(self.kind_k[kind][place] for kind, place in zip(self.kind_of, self._place))
            values = tuple(self.kind_v[kind][place] for kind, place in zip(self.kind_of, self._place))
            held = self._views = (tuple(self.kind_k), tuple(self.kind_v), keys, values)
        return held[2], held[3]

    def get_view(self, layer: int, metadata: Sequence[RotatingCacheInputMetadata]) -> CacheView:
        """Layer ``layer``'s buffers seen through its kind's metadata (``get_input_metadata``)."""
        kind, place = self.kind_of[layer], self._place[layer]
        slack = self.slack
        if slack is None or slack.keys[kind] is None:
            return CacheView(self.kind_k[kind][place], self.kind_v[kind][place], metadata[kind])
        keys, values = self.kind_k[kind][place], self.kind_v[kind][place]
        return CacheView(keys, values, metadata[kind], slack.keys[kind][place], slack.values[kind][place])

    def advance(self, chunk_lengths: List[int]) -> None:
        """Count a chunk's tokens as seen, once every layer has written them."""
        self.tokens_seen = [seen + n for seen, n in zip(self.tokens_seen, chunk_lengths)]


def can_cut_back(seen: int, length: int, slots: int, window: Optional[int], saved: int = 0) -> bool:
    """Whether a row of ``slots`` slots that has seen ``seen`` tokens, and keeps ``saved`` positions it
    pushed out beside them (slack, ``SlackSlots``), still holds the state of its first ``length``
    tokens: the window before ``length``, positions ``max(0, length - W) .. length - 1``, must be among
    those it holds, ``max(0, seen - slots) - saved .. seen - 1``. ``window`` None: no window (every
    position is read). The one rule of stepping a row back, for serving's prefix reuse
    (``serve.prefix_reuse``, which has the worked table) and speculative decoding's rejected guesses
    (``generation.speculative``): k guesses rejected after the row wrapped need k saved positions.

    >>> [can_cut_back(5, m, 4, 4) for m in (3, 4, 5)]
    [False, False, True]
    >>> [can_cut_back(4, m, 4, 4) for m in (0, 3, 4)]
    [True, True, True]
    >>> [can_cut_back(7, m, 4, 4, saved=2) for m in (4, 5, 7)]
    [False, True, True]

    Speculation, W = S = 4, slack k = 3: a row at 10 tokens checks 3 guesses (feeds 4 tokens, seen 14,
    saved 3): all rejected, it steps back to 11; exactly k back is the most, k + 1 is refused.

    >>> [can_cut_back(14, m, 4, 4, saved=3) for m in (11, 10)]
    [True, False]
    """
    if not 0 <= length <= seen:
        return False
    window = slots if window is None else window
    return max(0, length - window) >= max(0, seen - slots) - saved



class SlackSlots:
    """A few slots beside each row's windowed buffers that keep the positions the buffer pushed out
    last, so that a row which has wrapped can be cut back up to ``slack`` tokens (``cut_back``):
    serving's prefix reuse, where a regenerated answer or an edited last message goes back a few
    tokens into a long conversation. Attention never reads them.

    In a windowed buffer of S slots, writing position p overwrites position p - S ("pushes it out").
    Before a pass writes, ``save`` copies each row's positions about to be pushed out into its slack
    slot ``p % slack``, so a row that has seen ``seen`` tokens keeps, beside the positions
    ``seen - S .. seen - 1`` of its buffer, the ``saved`` (at most ``slack``) before them. A chunk longer
    than S also pushes out positions of its own, which the buffer never holds: ``Transformer.forward``
    writes them to the slack as it writes the buffer (``CacheView.update``, ``slack_writes``: the
    cache knows its slack, ``RotatingBufferCache.slack``); a pass that writes the cache itself (the
    serving engine's static steps) does not, and leaves the row none saved (``save(..., in_pass=False)``).
    A full-attention buffer never wraps: nothing to keep.

    Worked example, S = 4, slack 3, one row that reads positions 0..3 then decodes 4, 5, 6, each step
    pushing out one position::

        seen 7: buffer slots [4 5 6 3], slack slots [0 1 2], saved 3
        cut_back(row, 5): its window is positions 1..4; 1 and 2 come back from the slack
        seen 5: buffer slots [4 1 2 3], saved 1 (position 0, still beside them)

    ``saved[row][kind]``: per row, per kind of layer (``RotatingBufferCache.kinds``), how many positions
    are kept; 0 for a full-attention kind.
    """

    def __init__(self, cache: RotatingBufferCache, slack: int):
        if as_int(slack) is None or slack < 0:
            raise GenerationError(f"slack={slack!r}: the slots kept beside each row must be an integer >= 0")
        self.cache, self.slack = cache, as_int(slack)
        self.keys: List[Optional[torch.Tensor]] = []  # per kind: (L_kind, B_max, slack, H_kv, Dh), None where none is kept
        self.values: List[Optional[torch.Tensor]] = []
        for index, kind in enumerate(cache.kinds):
            kept = self.slack > 0 and kind.window is not None
            shape = (cache.kind_k[index].shape[0], cache.max_batch_size, self.slack, cache.n_kv_heads, cache.head_dim)
            self.keys.append(torch.zeros(shape, dtype=cache.dtype, device=cache.device) if kept else None)
            self.values.append(torch.zeros(shape, dtype=cache.dtype, device=cache.device) if kept else None)
        self.saved: List[List[int]] = [[0] * len(cache.kinds) for _ in range(cache.max_batch_size)]
        if any(t is not None for t in self.keys):
            cache.slack = self  # Transformer.forward's passes write the positions a chunk pushes out itself

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values if t is not None)

    def save(self, chunk_lengths: Sequence[int], in_pass: bool = True) -> None:
        """Keep the positions a pass of ``chunk_lengths`` tokens per row is about to push out of the
        buffers (before it writes them; ``cache.tokens_seen`` as before the pass). ``in_pass``: the pass
        writes those a chunk pushes out itself (``Transformer.forward``); else a row whose chunk does
        keeps none."""
        seen = self.cache.tokens_seen
        for index, kind in enumerate(self.cache.kinds):
            if self.keys[index] is None:
                continue
            size, slack = kind.size, self.slack
            source: List[int] = []  # flat slot b * S + p % S of each position kept
            target: List[int] = []  # its flat slack slot b * slack + p % slack
            for row, n in enumerate(chunk_lengths):
                first, end = max(0, seen[row] - size), max(0, seen[row] + n - size)  # pushed out: first .. end - 1
                if end == first:
                    continue
                if end > seen[row] and not in_pass:  # the chunk pushes out positions of its own, never stored
                    self.saved[row][index] = 0
                    continue
                for p in range(max(first, end - slack), min(end, seen[row])):  # the pass writes those from `seen` on
                    source.append(row * size + p % size)
                    target.append(row * slack + p % slack)
                self.saved[row][index] = min(slack, self.saved[row][index] + end - first)
            if source:
                self._move(self.cache.kind_k[index], self.keys[index], source, target)
                self._move(self.cache.kind_v[index], self.values[index], source, target)

    @staticmethod
    def _move(from_: torch.Tensor, to: torch.Tensor, source: List[int], target: List[int]) -> None:
        """``to``'s flat slots ``target`` = ``from_``'s flat slots ``source`` (flat over rows and slots), in every layer."""
        device = from_.device
        flat_from = from_.flatten(1, 2)  # (L_kind, B_max * S_from, H_kv, Dh), a view
        flat_to = to.flatten(1, 2)
        picked = flat_from.index_select(1, torch.tensor(source, dtype=torch.long, device=device))
        flat_to.index_copy_(1, torch.tensor(target, dtype=torch.long, device=device), picked)

    def can_cut_back(self, row: int, length: int) -> bool:
        """Whether ``cut_back(row, length)`` can be done: every kind of layer still holds the window
        before ``length`` (``can_cut_back``)."""
        seen = self.cache.tokens_seen[row]
        return all(
            can_cut_back(seen, length, kind.size, kind.window, self.saved[row][index])
            for index, kind in enumerate(self.cache.kinds)
        )

    def cut_back(self, row: int, length: int) -> None:
        """Make ``row`` hold the state of its first ``length`` tokens: the positions of its window that
        its buffers pushed out come back from the slack; ``cache.tokens_seen[row]`` becomes ``length``.
        GenerationError where they are no longer kept (``can_cut_back`` says which)."""
        seen = self.cache.tokens_seen[row]
        if not 0 <= length <= seen:
            raise GenerationError(f"cut_back({row}, {length}): row {row} has seen {seen} tokens")
        moves = []
        for index, kind in enumerate(self.cache.kinds):
            size = kind.size
            pushed, kept = max(0, seen - size), self.saved[row][index]  # positions pushed - kept .. pushed - 1 are kept
            back = range(max(0, length - size), min(length, pushed))  # in the window before `length`, pushed out
            if len(back) and back.start < pushed - kept:
                raise GenerationError(f"cut_back({row}, {length}): row {row} ({seen} tokens seen) keeps positions from "
                                      f"{pushed - kept} on in its layers of {size} slots, not {back.start}")  # fmt: skip
            moves.append(back)
        for index, (kind, back) in enumerate(zip(self.cache.kinds, moves)):
            if len(back):
                source = [row * self.slack + p % self.slack for p in back]
                target = [row * kind.size + p % kind.size for p in back]
                self._move(self.keys[index], self.cache.kind_k[index], source, target)
                self._move(self.values[index], self.cache.kind_v[index], source, target)
            pushed, now = max(0, seen - kind.size), max(0, length - kind.size)
            self.saved[row][index] = max(0, min(now, self.saved[row][index] - (pushed - now)))
        self.cache.tokens_seen[row] = length

    def copy_row(self, source: int, target: int, length: int) -> None:
        """Put into row ``target`` the state of row ``source``'s first ``length`` tokens (``cut_back``),
        slack slots included; ``source`` stays as it is. Copies only the slots ``0 .. length - 1`` of a
        buffer that has not wrapped (``copied_slots``), the whole buffer of one that has."""
        seen = self.cache.tokens_seen[source]
        for index, kind in enumerate(self.cache.kinds):
            part = copied_slots(length, kind.size) if seen <= kind.size else None
            part = slice(None) if part is None else part
            for buffer in (self.cache.kind_k[index], self.cache.kind_v[index]):
                buffer[:, target, part] = buffer[:, source, part]
            for buffer in (self.keys[index], self.values[index]):
                if buffer is not None:
                    buffer[:, target] = buffer[:, source]
        self.saved[target] = list(self.saved[source])
        self.cache.tokens_seen[target] = seen
        self.cut_back(target, length)

    def forget(self, row: int) -> None:
        """``row`` keeps nothing beside its slots (its sequence ended, or its slots were cleared)."""
        self.saved[row] = [0] * len(self.cache.kinds)
