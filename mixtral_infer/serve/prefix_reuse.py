"""Which cache row a new request continues, and from how many of its tokens.

A row of the rotating cache holds the keys and values of the last ``S`` positions of its
sequence (position ``p`` in slot ``p % S``), with ``S`` the window ``W`` (or, without a window,
the longest sequence a row takes). A windowed model continuing a sequence of ``m`` tokens reads
only positions ``m - W .. m - 1``, so a row is a complete state of its sequence however long the
conversation was. When a request has finished, its row keeps its contents and the token ids they
came from (``RowState.ids``) until another request needs the row.

Cutting a row back. A row that has seen ``h`` tokens can serve a sequence of its first
``m <= h`` tokens when it still holds positions ``max(0, m - W) .. m - 1`` unchanged: it holds
positions ``max(0, h - S) .. h - 1``, so the condition is ``h <= S`` (it never wrapped) or
``h - m <= S - W`` (the slots beyond the window, none when ``S == W``). Positions ``m .. h - 1``
left in the row are never seen: a row at position ``m`` attends to slots below ``min(m, S)``, and
writes position ``m`` over them as it goes on (``can_cut_back``).

Worked example, ``S = W = 4``:

=====  ====================  ==========================  ==================
h      row slots 0 1 2 3      cut back to m               why
=====  ====================  ==========================  ==================
3      p0 p1 p2 --           m = 0, 1, 2, 3              never wrapped
4      p0 p1 p2 p3           m = 0 .. 4                  never wrapped (m = W)
5      p4 p1 p2 p3           m = 5 only                  wrapped: p0 is gone, and m = 4 would
                                                         need p0 .. p3 (m = W + 1 needs p1 .. p4)
=====  ====================  ==========================  ==================

Per layer. Each layer's buffer is sized on its own (``model.cache.layer_cache_sizes``): a windowed
layer holds its window ``W`` (``S = W``), a full-attention one every position of the longest sequence
(``S = max_model_len``, never wrapped). The rule above holds in each layer, and a row can be cut
back to ``m`` only where every layer can: ``reusable_length`` takes the kinds of layers
(``RotatingBufferCache.kinds``). Ministral's layers, ``[full, W, W, W]``: the full-attention layers
never stand in the way, the windowed ones decide (a row cut back before it wraps, or continued at its end).

Matching. A request's prompt is compared with a row's ids token by token (ids after the chat
template, never text). The longest common prefix ``c`` is cut to the longest length the row can be
cut back to, and to ``len(prompt) - 1`` (the last prompt token is always fed: its logits give the
first new token), giving ``reusable_length``. A row left by a request that ended after its answer
holds the prompt and every answer token but the last sampled one (sampled, never fed); the next turn
of a chat sends the prompt, the whole answer and the next message, so it continues the row at its
exact end, and the answer's last token is the first one fed.

Placement (``place``): the row with the longest reusable prefix wins (ties: a free row, then the
most recently used). A free row is taken as it is, no copy, when the request continues it at its end, or when no
other free row is left; otherwise the prefix is copied into a free row (only the slots it needs), so
the source keeps its own sequence for its own next turn: this is how a shared system prompt serves
many users. A row that is still running can be a source too (the engine pauses a prompt being read
at the length a waiting request shares with it, so the copy is taken at the row's end, exact even
past the window). Among free rows, one that holds nothing goes first, then the least recently used.
A match shorter than ``MIN_REUSED_TOKENS`` is read again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, List, Optional, Sequence

from mixtral_infer.model.cache import BufferKind

# A shorter prefix is read again: reading a few tokens costs little, and a prompt read after
# tokens already in its row takes the attention path over the cache, slower for a fresh prompt.
MIN_REUSED_TOKENS = 16


@dataclass
class RowState:
    """What one row of the cache holds: the token ids of the positions it has seen (their keys and
    values are in the row) and when it was last used (a counter: larger is more recent)."""

    ids: List[int] = field(default_factory=list)
    last_used: int = 0


@dataclass(frozen=True)
class Placement:
    """Where a request goes: ``row``, starting after ``reused`` tokens; those come from ``source``
    (copied) unless ``source`` is None (already in ``row``, or ``reused`` is 0)."""

    row: int
    reused: int
    source: Optional[int] = None


def can_cut_back(seen: int, length: int, slots: int, window: Optional[int]) -> bool:
    """Whether a row of ``slots`` slots that has seen ``seen`` tokens still holds the state of its first
    ``length`` tokens (module docstring). ``window`` None: no window (every position is read).

    >>> [can_cut_back(5, m, 4, 4) for m in (3, 4, 5)]
    [False, False, True]
    >>> [can_cut_back(4, m, 4, 4) for m in (0, 3, 4)]
    [True, True, True]
    """
    if not 0 <= length <= seen:
        return False
    window = slots if window is None else window
    return seen <= slots or seen - length <= slots - window


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable_length(held: Sequence[int], prompt: Sequence[int], kinds: Sequence[BufferKind]) -> int:
    """How many of ``prompt``'s first tokens a row holding ``held`` can skip: the longest common prefix,
    at most ``len(prompt) - 1``, cut to a length the row can be cut back to in every kind of layer
    (``kinds``: each one's slots and window; 0 if none).

    With ``slots = window = 4``, a row that has seen ``[1, 5, 6, 7, 8]`` (wrapped) serves
    ``[1, 5, 6, 7, 8, 9]`` from 5 tokens, but ``[1, 5, 6, 7, 2]`` from none: the row no longer holds
    the state of its first 4 tokens. A full-attention layer of 64 slots beside it changes neither.
    """
    longest = min(common_prefix(held, prompt), len(prompt) - 1)
    if longest <= 0:
        return 0
    return longest if all(can_cut_back(len(held), longest, kind.size, kind.window) for kind in kinds) else 0


def place(
    prompt: Sequence[int], rows: Sequence[RowState], busy: Collection[int], kinds: Sequence[BufferKind]
) -> Optional[Placement]:
    """Where ``prompt`` goes among ``rows``, those in ``busy`` held by running requests (module
    docstring, "Placement"); None when no row is free."""
    free = [r for r in range(len(rows)) if r not in busy]
    if not free:
        return None
    best, source, best_key = 0, None, None
    for r, state in enumerate(rows):
        n = reusable_length(state.ids, prompt, kinds)
        key = (n, r not in busy, state.last_used)  # the longest; then a free row (no copy); then the most recent
        if n > 0 and (best_key is None or key > best_key):
            best, source, best_key = n, r, key
    spare = spare_rows(rows, free)
    if source is None or best < MIN_REUSED_TOKENS:
        return Placement(spare[0], 0)
    others = [r for r in spare if r != source]
    if source not in busy and (best == len(rows[source].ids) or not others):
        return Placement(source, best)  # continued where it is, nothing copied
    return Placement(others[0], best, source)


def spare_rows(rows: Sequence[RowState], free: Sequence[int]) -> List[int]:
    """The ``free`` rows, the ones worth least first: those holding nothing, then the least recently used."""
    return sorted(free, key=lambda r: (len(rows[r].ids) > 0, rows[r].last_used))

