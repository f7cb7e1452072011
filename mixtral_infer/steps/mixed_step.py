"""The static mixed step: every decoding row's next token and a chunk of prompt tokens in one
pass of fixed shapes.

A continuous-batching engine (``serve.engine``) mostly decodes, but about half its steps also
read a prompt: a new request takes the row another one freed. ``decode_one_token`` covers only
the first kind of step. The second ran ``Transformer.forward``, whose metadata, masks and
ragged gathers are built on the host at every step; on a small model on CPU, and on a GPU at any
size, the host is what that pass waits for. This step reads the prompts in fixed shapes, so it
compiles (``Engine(decode="compiled")``) as the decode step does.

**The chunk** holds C prompt tokens of up to K prompts (segments), packed (``PromptChunk``):

* ``tokens``, ``positions``, ``segment``, ``valid`` ``(C,)``: token t is a token of segment
  ``segment[t]`` at position ``positions[t]``; padding tokens are not ``valid``;
* ``rows``, ``starts``, ``last`` ``(K,)``: each segment's cache row, the tokens that row had seen
  before this chunk, and the index in the chunk of the segment's last token (its logits choose
  the prompt's first new token when the prompt ends in this chunk).

A compiled step pads C and K to fixed sizes (``pack_chunk``); the data decides the rest.

**Attention** (``chunk_visibility``): a chunk token sees the cached slots of its own segment's row
and the chunk's tokens of its own segment up to itself, within the window. Each segment attends
as one line of P places in a batch of K (``PromptChunk.place``; P is the longest piece, or C when
padded): its row's S slots and its own chunk tokens, ``S + P`` keys under a mask, so one prompt
never reads another's keys. Slot j of a row that has
seen s tokens holds position ``s - 1 - ((s - 1 - j) mod S)``, the latest position that is j
modulo S, when it is not negative.

**Writes** (``chunk_writes``): after the layer's attention has read the old slots, each chunk
token's key and value go to slot ``position % S`` of its row. A chunk longer than S writes some
slots twice, and the later token must win; so each token writes the value of the latest token of
its segment that shares its slot, and tokens that collide write the same value in whatever order
the writes land. A padding token repeats the write of the last valid token.

Worked example, S = 4, window 4, C = 6, K = 2. Segment 0 is row 1, which has seen 6 tokens (its
slots hold positions [4, 5, 2, 3]), and reads 3 tokens at positions 6, 7, 8; segment 1 is row 0,
new, and reads 2 tokens at 0, 1; one padding token::

    segment  [0, 0, 0, 1, 1, -]     positions [6, 7, 8, 0, 1, -]     place in the segment [0, 1, 2, 0, 1, 5]
    position 6 sees cached positions 3, 4, 5 (slots 3, 0, 1; position 2 is out of its window)
               and itself; position 8 sees cached position 5 and chunk positions 6, 7, 8
    writes   row 1: slots 2, 3, 0 <- positions 6, 7, 8; row 0: slots 0, 1 <- positions 0, 1

Each layer runs the decode step's block (``decode_step.block``, the one pass both steps share) with
the chunk: the decoding rows attend in place over their own buffers after the chunk; a row that
reads a prompt sits out of that part (``alive`` false), so it writes there only what its slot held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from mixtral_infer.formats.modules import tuning_of
from mixtral_infer.model.rope import rotary_angles
from mixtral_infer.model.transformer import Transformer
from mixtral_infer.steps import decode_step
from mixtral_infer.steps.decode_step import in_regions, layer_buffers, slots_and_visibility
from mixtral_infer.tuning import Tuning


@dataclass
class PromptChunk:
    """Prompt tokens of up to K rows, packed into C (see the module docstring)."""

    tokens: torch.Tensor  # (C,) long
    positions: torch.Tensor  # (C,) long
    segment: torch.Tensor  # (C,) long, in [0, K)
    place: torch.Tensor  # (C,) long: the token's index within its segment, its place in the (K, P) layout
    valid: torch.Tensor  # (C,) bool
    rows: torch.Tensor  # (K,) long
    starts: torch.Tensor  # (K,) long: tokens the row had seen before this chunk
    last: torch.Tensor  # (K,) long: the chunk index of the segment's last token
    line: int  # P, the places of a segment's line in the (K, P) layout: at least its longest piece


def pack_chunk(
    pieces: Sequence[Tuple[int, int, Sequence[int]]],  # (row, tokens seen before, tokens) per prompt
    size: Optional[int] = None,
    segments: Optional[int] = None,
    device: torch.device | str = "cpu",
    line: Optional[int] = None,
) -> PromptChunk:
    """The pieces packed in order, padded to ``size`` tokens and ``segments`` segments (None: no
    padding). A padding segment points at row 0 and holds no token; a padding token is segment 0's.
    The layout's lines hold ``size`` places when padded (a fixed shape), else the longest piece;
    with ``line`` (speculative decoding's verify step: every piece holds at most k + 1 tokens), lines
    of ``line`` places, ``size = segments * line``, each padding token in a place no piece takes.

    >>> chunk = pack_chunk([(1, 6, [11, 12, 13]), (0, 0, [21, 22])], size=6, segments=3)
    >>> chunk.positions.tolist(), chunk.segment.tolist(), chunk.last.tolist(), chunk.line
    ([6, 7, 8, 0, 1, 0], [0, 0, 0, 1, 1, 0], [2, 4, 0], 6)
    >>> chunk.place.tolist()  # the padding token is segment 0's, at its own index
    [0, 1, 2, 0, 1, 5]
    >>> pack_chunk([(1, 6, [11, 12, 13]), (0, 0, [21, 22])]).line
    3
    >>> verify = pack_chunk([(1, 6, [11, 12, 13]), (0, 0, [21, 22])], size=9, segments=3, line=3)
    >>> verify.segment.tolist(), verify.place.tolist()  # padding in segment 1's last place, then segment 2's
    ([0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2, 0, 1, 2])
    """
    tokens: List[int] = []
    positions: List[int] = []
    segment: List[int] = []
    place: List[int] = []
    last: List[int] = []
    for index, (_, start, piece) in enumerate(pieces):
        if not piece:
            raise ValueError("a prompt piece of a chunk holds no token")
        tokens.extend(piece)
        positions.extend(range(start, start + len(piece)))
        segment.extend([index] * len(piece))
        place.extend(range(len(piece)))
        last.append(len(tokens) - 1)
    n_valid, n_pieces = len(tokens), len(pieces)
    pad_places: List[Tuple[int, int]] = []  # (segment, place) of each padding token, with ``line``
    if line is not None:
        if size is None or segments is None or size != segments * line or any(len(p) > line for _, _, p in pieces):
            raise ValueError(f"a chunk of lines of {line} places needs size = segments * line and pieces of at most {line} tokens")
        used = [len(piece) for _, _, piece in pieces] + [0] * (segments - n_pieces)
        pad_places = [(s, p) for s in range(segments) for p in range(used[s], line)]
    line = line if line is not None else max(len(piece) for _, _, piece in pieces) if size is None else size
    size = n_valid if size is None else size
    segments = n_pieces if segments is None else segments
    if n_valid > size or n_pieces > segments or n_valid == 0:
        raise ValueError(f"{n_valid} tokens of {n_pieces} prompts do not fit a chunk of {size} tokens, {segments} segments")
    pad, pad_segments = size - n_valid, segments - n_pieces
    if pad_places:
        segment.extend(s for s, _ in pad_places)
        place.extend(p for _, p in pad_places)

    def tensor(values, dtype=torch.long):
        return torch.tensor(values, dtype=dtype, device=device)

    return PromptChunk(
        tokens=tensor(tokens + [0] * pad),
        positions=tensor(positions + [0] * pad),
        segment=tensor(segment + [0] * (size - len(segment))),
        place=tensor(place + list(range(n_valid, size))[: size - len(place)]),  # segment 0 starts at 0: a padding token's index
        valid=tensor([True] * n_valid + [False] * pad, torch.bool),
        rows=tensor([row for row, _, _ in pieces] + [0] * pad_segments),
        starts=tensor([start for _, start, _ in pieces] + [0] * pad_segments),
        last=tensor(last + [0] * pad_segments),
        line=line,
    )


def chunk_rows(chunk: PromptChunk) -> torch.Tensor:
    """Each chunk token's cache row ``(C,)`` (a padding token: its segment's, row 0 for a padding segment)."""
    return chunk.rows[chunk.segment]


def cached_positions(starts: torch.Tensor, n_slots: int) -> torch.Tensor:
    """The position each slot of a row holds ``(K, S)`` after the row has seen ``starts`` tokens;
    negative where the slot was never written. ``starts`` [6, 0, 2], S = 4:
    ``[[4, 5, 2, 3], [-4, -3, -2, -1], [0, 1, -2, -1]]``."""
    before = starts[:, None] - 1  # (K, 1) the latest position seen
    slot = torch.arange(n_slots, device=starts.device)[None, :]  # (1, S)
    return before - torch.remainder(before - slot, n_slots)  # (K, S)


def chunk_visibility(chunk: PromptChunk, n_slots: int, window: Optional[int]) -> torch.Tensor:
    """Which keys each place of the ``(K, P)`` layout sees, ``(K, P, S + P)`` bool: its row's S
    slots, then its segment's chunk tokens (``PromptChunk.place``).

    A place of the layout that holds no token sees its own (zero) key, so that no row of
    scores is empty; its output is never read.
    """
    n_places, n_segments = chunk.line, chunk.rows.shape[0]
    device = chunk.tokens.device
    where = (chunk.segment, chunk.place)
    layout = (n_segments, n_places)
    position = torch.zeros(layout, dtype=torch.long, device=device).index_put(where, chunk.positions)
    valid = torch.zeros(layout, dtype=torch.bool, device=device).index_put(where, chunk.valid)
    query = position[:, :, None]  # (K, P, 1)
    slot_position = cached_positions(chunk.starts, n_slots)[:, None, :]  # (K, 1, S)
    cached = valid[:, :, None] & (slot_position >= 0)  # (K, P, S)
    in_chunk = valid[:, :, None] & valid[:, None, :] & (position[:, None, :] <= query)  # (K, P, P)
    if window is not None:
        cached &= (query - slot_position) < window
        in_chunk &= (query - position[:, None, :]) < window
    in_chunk |= torch.eye(n_places, dtype=torch.bool, device=device)
    return torch.cat([cached, in_chunk], dim=2)


def chunk_writes(chunk: PromptChunk, n_slots: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each chunk token writes and whose key it writes: ``(rows, slots, source)``, each ``(C,)``.

    One segment at row 2, new, 6 tokens, S = 4: positions 0..5 go to slots 0, 1, 2, 3, 0, 1;
    tokens 0 and 4 both write token 4's key to slot 0, tokens 1 and 5 token 5's to slot 1:
    source ``[4, 5, 2, 3, 4, 5]``. The chunk must hold at least one valid token.
    """
    n_tokens = chunk.tokens.shape[0]
    index = torch.arange(n_tokens, device=chunk.tokens.device)
    slot = chunk.positions % n_slots  # (C,)
    shares = (chunk.segment[:, None] == chunk.segment[None, :]) & (slot[:, None] == slot[None, :]) & chunk.valid[None, :]
    source = torch.where(shares, index[None, :], -1).amax(dim=1)  # (C,) the latest token sharing t's row and slot
    last_valid = torch.where(chunk.valid, index, -1).amax()
    source = torch.where(chunk.valid, source, last_valid)
    return chunk.rows[chunk.segment[source]], slot[source], source


def mixed_logits(
    model: Transformer,
    cache_k: torch.Tensor | Sequence[torch.Tensor],  # L x (R, S, H_kv, Dh): decode_step.layer_buffers
    cache_v: torch.Tensor | Sequence[torch.Tensor],  # L x (R, S, H_kv, Dh)
    tokens: torch.Tensor,  # (R,) each row's last token
    positions: torch.Tensor,  # (R,) the position each takes
    alive: torch.Tensor,  # (R,) bool: the row decodes now (rows in the chunk do not)
    chunk: PromptChunk,
    grouped_moe: bool = False,
    tuning: Optional[Tuning] = None,
) -> torch.Tensor:
    """Float logits ``(R + K, V)``: each row's next token, then each segment's after its last chunk token.

    Writes the alive rows' new keys and the chunk's. The cache, ``grouped_moe`` and ``tuning`` as
    in ``decode_logits``; compiled, every block is one region too (``decode_step.block``).
    """
    h = mixed_hidden(model, cache_k, cache_v, tokens, positions, alive, chunk, grouped_moe, tuning)  # (R + C, D)
    ends = torch.cat([torch.arange(tokens.shape[0], device=h.device), tokens.shape[0] + chunk.last])  # (R + K,)
    return model.output(model.norm(h[ends])).float()  # (R + K, V)


def verify_logits(
    model: Transformer,
    cache_k: torch.Tensor | Sequence[torch.Tensor],  # L x (R, S, H_kv, Dh)
    cache_v: torch.Tensor | Sequence[torch.Tensor],
    positions: torch.Tensor,  # (R,) each row's tokens seen (no row decodes: the chunk holds every token)
    chunk: PromptChunk,
    grouped_moe: bool = False,
    tuning: Optional[Tuning] = None,
) -> torch.Tensor:
    """Float logits after every chunk token ``(C, V)``: speculative decoding's verify step. Each
    checking row is a segment of the chunk, its last token and its k guesses (``generation.speculative``),
    so the model checks k + 1 tokens a row in the mixed step's one pass of fixed shapes; padding
    tokens' logits are left to the caller to ignore."""
    alive = torch.zeros_like(positions, dtype=torch.bool)  # (R,) no row decodes alone
    h = mixed_hidden(model, cache_k, cache_v, torch.zeros_like(positions), positions, alive, chunk, grouped_moe, tuning)
    return model.output(model.norm(h[positions.shape[0] :])).float()  # (C, V)


def mixed_hidden(
    model: Transformer,
    cache_k: torch.Tensor | Sequence[torch.Tensor],
    cache_v: torch.Tensor | Sequence[torch.Tensor],
    tokens: torch.Tensor,  # (R,)
    positions: torch.Tensor,  # (R,)
    alive: torch.Tensor,  # (R,) bool
    chunk: PromptChunk,
    grouped_moe: bool = False,
    tuning: Optional[Tuning] = None,
) -> torch.Tensor:
    """The last block's output ``(R + C, D)`` of the decoding rows, then the chunk's tokens (``mixed_logits``)."""
    tuning = tuning if tuning is not None else tuning_of(model)
    keys, values = layer_buffers(cache_k), layer_buffers(cache_v)
    windows = model.layer_windows
    masks: dict = {}  # per kind of layer (slots S, window): what its attention reads and writes
    for layer_k, window in zip(keys, windows):
        n_slots = layer_k.shape[1]
        if (n_slots, window) not in masks:
            slots, visible = slots_and_visibility(positions, n_slots)  # (R,), (R, S)
            chunk_visible = chunk_visibility(chunk, n_slots, window)  # (K, P, S + P)
            masks[n_slots, window] = (slots, visible, chunk_visible, chunk_writes(chunk, n_slots))
    rotary = rotary_angles(torch.cat([positions, chunk.positions]), model.args.head_dim, model.args.rope_theta)

    run = decode_step.block_region if in_regions(tuning.regions) else decode_step.block  # the decode step's pass
    h = model.tok_embeddings(torch.cat([tokens, chunk.tokens]))  # (R + C, D)
    for layer, layer_k, layer_v, window in zip(model.layers.values(), keys, values, windows):
        slots, visible, chunk_visible, writes = masks[layer_k.shape[1], window]
        h = run(layer, h, rotary, layer_k, layer_v, slots, alive, visible, grouped_moe, tuning, chunk, chunk_visible, writes)
    return h
