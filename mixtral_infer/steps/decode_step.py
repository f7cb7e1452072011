"""The static decode step: one new token for every sequence, fixed shapes, no host sync.

The eager path (``Transformer.forward`` with a cache) is the readable reference: it builds
metadata from Python lists, picks the rows still running, and lets the bias object say
which keys each query sees. Every one of those steps costs the host a few microseconds or
a device sync, and on a GPU they cost more than reading the weights. This module is the
same decoding step written the way gpt-fast writes ``decode_one_token``:

* every input is a device tensor of a fixed shape: the last token of each of the B rows
  ``(B,)``, the position it takes ``(B,)`` (the tokens the row has seen), and ``alive``
  ``(B,)``, false for a row that has finished (it keeps its place, so shapes never change);
* the key/value of row b goes to slot ``position % S`` of its buffer, by arithmetic; a
  finished row writes back what its slot held, so the cache stays as the eager path leaves it;
  each layer's buffers ``(B, S, H_kv, Dh)`` are inputs of their own (``layer_buffers``), which
  compiled code writes in place (``write_slots``);
* attention covers the fixed ``(B, S)`` buffer with a mask made on the device, slot
  ``j`` visible when ``j < min(position + 1, S)``: decoding does not care about slot order,
  because after the buffer has wrapped every slot holds one of the last S positions;
* the mixture of experts gathers the chosen experts when fewer than E are chosen in all,
  and otherwise runs every expert on every token, weighted by a routing matrix that is zero
  for the experts a token did not choose (``moe_one_token``); either way the step reads
  each expert it needs once and its shapes do not depend on the routing;
* the next token is sampled on the device (``sampling.sample``) from a uniform number the
  caller draws, so the host only reads tokens when it wants them.

Worked example, S = 4 slots, one row at position 6 (it has seen positions 0..5): its key
goes to slot ``6 % 4 = 2`` and all ``min(6 + 1, 4) = 4`` slots are visible; they hold
positions ``[4, 5, 6, 3]``, the last 4. A row at position 1 writes slot 1 and sees slots
0 and 1.

``decode_one_token`` compiles with ``torch.compile(fullgraph=True)``: there is nothing in it
to break the graph, and each block is a region compiled once for all layers (``in_regions``).
``steps.compiler`` builds it (on CUDA replayed as a CUDA graph, on CPU by AOTInductor).

Which forms the step takes (regions, the experts' forms, the places reductions read in) is a
``Tuning``: passed in, by default the model's (``formats.modules.tuning_of``). Its fields are read
when the step is traced.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from mixtral_infer.sampling import Sampling, sample, token_logprobs
from mixtral_infer.structured.rows import shaped_logits
from mixtral_infer.model.attention import one_query_sdpa
from mixtral_infer.formats.modules import tuning_of
from mixtral_infer.kernels.moe import moe_one_token
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.model.rope import rotary_angles
from mixtral_infer.model.transformer import Transformer, TransformerBlock
from mixtral_infer.tuning import Tuning

StepOutputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def supports_static_decode(model: Transformer) -> bool:
    """The static step runs a whole model in one process (no tensor or pipeline parallelism)."""
    return model.parallel.world_size == 1


def layer_buffers(buffers: torch.Tensor | Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """A cache's keys (or values) layer by layer: L buffers ``(B_max, S, H_kv, Dh)``. A whole
    ``(L, B_max, S, H_kv, Dh)`` buffer is split into its L views; a sequence of them is taken as it is.

    A compiled step takes the L views as its inputs, made outside it (``RotatingBufferCache.
    layer_keys``), and writes each in place (``write_slots``). Views made inside a compiled step are
    views of one graph input, and a write through one of them is traced as a write into a copy of
    the whole input (``select_scatter``): every layer's write would copy the whole cache."""
    return buffers.unbind(0) if isinstance(buffers, torch.Tensor) else buffers


def write_slots(
    layer_k: torch.Tensor,  # (B_max, S, H_kv, Dh) one layer's buffers
    layer_v: torch.Tensor,  # (B_max, S, H_kv, Dh)
    rows: torch.Tensor,  # (N,)
    slots: torch.Tensor,  # (N,)
    keys: torch.Tensor,  # (N, H_kv, Dh)
    values: torch.Tensor,  # (N, H_kv, Dh)
) -> None:
    """``layer_k[rows, slots] = keys`` and the same for values: one ``index_put_`` into each buffer,
    in place (compiled too, where the buffers are the step's inputs: ``layer_buffers``)."""
    layer_k.index_put_((rows, slots), keys)
    layer_v.index_put_((rows, slots), values)


def attend_in_place(
    xq: torch.Tensor,  # (B, H, Dh)
    xk: torch.Tensor,  # (B, H_kv, Dh)
    xv: torch.Tensor,  # (B, H_kv, Dh)
    layer_k: torch.Tensor,  # (B_max, S, H_kv, Dh) one layer's buffers
    layer_v: torch.Tensor,  # (B_max, S, H_kv, Dh)
    slots: torch.Tensor,  # (B,)
    alive: torch.Tensor,  # (B,) bool
    visible: torch.Tensor,  # (B, S) bool
) -> torch.Tensor:
    """Write each alive row's key and value to its slot of the layer's buffers, then its query
    over its row's buffer: ``(B, H, Dh)``."""
    batch = xq.shape[0]
    rows = torch.arange(batch, device=xq.device)
    keep = alive[:, None, None]  # (B, 1, 1)
    new_k = torch.where(keep, xk, layer_k[rows, slots])  # (B, H_kv, Dh): a finished row's own
    new_v = torch.where(keep, xv, layer_v[rows, slots])
    write_slots(layer_k, layer_v, rows, slots, new_k, new_v)
    keys, values = layer_k[:batch], layer_v[:batch]  # (B, S, H_kv, Dh) the rows' buffers
    if xq.device.type == "cpu" and torch.compiler.is_compiling():
        return one_query_attention(xq, keys, values, visible)
    return one_query_sdpa(xq, keys, values, visible[:, None, None, :])  # SDPA (in float32 on CPU)


def one_query_attention(
    xq: torch.Tensor,  # (B, H, Dh) one query per row
    keys: torch.Tensor,  # (B, S, H_kv, Dh) each row's buffer
    values: torch.Tensor,  # (B, S, H_kv, Dh)
    visible: torch.Tensor,  # (B, S) bool: the slots each row's query sees
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of one query per row (grouped heads: query head h reads
    key/value head h // (H / H_kv)), written out as products and sums for compiled CPU steps:
    ``(B, H, Dh)``, the scores and their softmax in float32.

    Compiled, inductor fuses it into a few loops over the buffer, which never hold the broadcast
    products. PyTorch's CPU kernel (a flash-attention kernel sized for many queries) is many times
    slower for one query. Op by op (the eager steps) it would hold the products, so those keep the
    kernel, given float32 inputs, for which it is fast (``model.attention.one_query_sdpa``)."""
    batch, n_heads, head_dim = xq.shape
    n_kv = keys.shape[2]
    q = xq.float().view(batch, 1, n_kv, n_heads // n_kv, head_dim)  # (B, 1, H_kv, G, Dh)
    scores = (q * keys.float()[:, :, :, None, :]).sum(-1) * head_dim**-0.5  # (B, S, H_kv, G)
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=1)  # over the slots
    out = (weights[..., None] * values.float()[:, :, :, None, :]).sum(1)  # (B, H_kv, G, Dh)
    return out.reshape(batch, n_heads, head_dim).to(xq.dtype)


def slots_and_visibility(positions: torch.Tensor, n_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row's slot ``position % S`` ``(B,)`` and the slots its query sees ``(B, S)``:
    ``j < min(position + 1, S)``. Positions ``[6, 1]``, S = 4: slots ``[2, 1]``, visible
    ``[[T, T, T, T], [T, T, F, F]]`` (the module docstring's example)."""
    slot_index = torch.arange(n_slots, device=positions.device)
    visible = slot_index[None, :] < torch.clamp(positions + 1, max=n_slots)[:, None]  # (B, S)
    return positions % n_slots, visible


def slots_by_layer(positions: torch.Tensor, keys: Sequence[torch.Tensor]) -> list:
    """``slots_and_visibility`` for each layer's buffer ``(B_max, S_layer, H_kv, Dh)``, made once per
    distinct size S: a full-attention layer's buffer holds the whole sequence, a windowed one's its window."""
    by_size: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
    for layer_k in keys:
        if layer_k.shape[1] not in by_size:
            by_size[layer_k.shape[1]] = slots_and_visibility(positions, layer_k.shape[1])
    return [by_size[layer_k.shape[1]] for layer_k in keys]


def decode_logits(
    model: Transformer,
    cache_k: torch.Tensor | Sequence[torch.Tensor],  # L x (B_max, S_layer, H_kv, Dh): layer_buffers; rows 0..B-1 are decoded
    cache_v: torch.Tensor | Sequence[torch.Tensor],  # L x (B_max, S, H_kv, Dh)
    tokens: torch.Tensor,  # (B,) each row's last token
    positions: torch.Tensor,  # (B,) the position each token takes = tokens the row has seen
    alive: torch.Tensor,  # (B,) bool
    grouped_moe: bool = False,
    tuning: Optional[Tuning] = None,
) -> torch.Tensor:
    """Float logits ``(B, V)`` of the next token of every row; writes the alive rows' keys/values.

    ``cache_k``/``cache_v``: each layer's buffers (``layer_buffers``; compiled callers pass the
    views ``RotatingBufferCache.layer_keys``/``layer_values``). ``grouped_moe``: experts through
    ``MoeLayer.forward`` (rows grouped by expert: shapes that depend on the routing, so eager only)
    instead of ``moe_one_token``. On CPU the latter's dense case, every expert on every row, is the
    slower op by op.

    Compiled, every block is one region (``block``): traced and compiled once, its code
    called once a layer (``in_regions``; ``tuning.regions`` False: every block written out).
    ``tuning``: None for the model's (``formats.modules.tuning_of``).
    """
    tuning = tuning if tuning is not None else tuning_of(model)
    keys, values = layer_buffers(cache_k), layer_buffers(cache_v)
    rotary = rotary_angles(positions, model.args.head_dim, model.args.rope_theta)

    run = block_region if in_regions(tuning.regions) else block
    h = model.tok_embeddings(tokens)  # (B, D)
    for layer, layer_k, layer_v, (slots, visible) in zip(model.layers.values(), keys, values, slots_by_layer(positions, keys)):
        h = run(layer, h, rotary, layer_k, layer_v, slots, alive, visible, grouped_moe, tuning)  # (B, D)
    return model.output(model.norm(h)).float()  # (B, V)


def block(
    layer: TransformerBlock,
    h: torch.Tensor,  # (R + C, D): the decoding rows' residual stream, then a prompt chunk's (C = 0: none)
    rotary: Tuple[torch.Tensor, torch.Tensor],  # cos, sin: (R + C, 1, Dh/2)
    layer_k: torch.Tensor,  # (B_max, S, H_kv, Dh) this layer's buffers
    layer_v: torch.Tensor,  # (B_max, S, H_kv, Dh)
    slots: torch.Tensor,  # (R,)
    alive: torch.Tensor,  # (R,) bool
    visible: torch.Tensor,  # (R, S) bool
    grouped_moe: bool,
    tuning: Tuning,
    chunk=None,  # steps.mixed_step.PromptChunk: the prompt tokens after the rows, or None
    chunk_visible: Optional[torch.Tensor] = None,  # (K, P, S + P) bool: mixed_step.chunk_visibility
    writes: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,  # mixed_step.chunk_writes
) -> torch.Tensor:
    """One transformer block, the one pass both fixed-shape steps run: each decoding row's token
    attends in place over its row's buffer; with a ``chunk`` (the serving engine's mixed step), the
    chunk's tokens attend first, over their rows' slots and their own prompt's tokens, and write
    theirs. Then the feed-forward: ``(R + C, D)``.

    Chunk first: the rows are apart (a row that reads a prompt sits out of decoding, writing back
    what its slot holds), so either order gives the same values, and in this one inductor writes
    the buffers in place (the other order had it copy each layer's buffers out and back)."""
    n_rows = slots.shape[0]
    attention = layer.attention
    xq, xk, xv = attention.project(layer.attention_norm(h), rotary)  # (R + C, H, Dh), (R + C, H_kv, Dh) x2
    if chunk is None:
        out = attend_in_place(xq, xk, xv, layer_k, layer_v, slots, alive, visible)  # (R, H, Dh)
    else:
        read = attend_chunk(xq[n_rows:], xk[n_rows:], xv[n_rows:], layer_k, layer_v, chunk, chunk_visible, writes)
        decoded = attend_in_place(xq[:n_rows], xk[:n_rows], xv[:n_rows], layer_k, layer_v, slots, alive, visible)
        out = torch.cat([decoded, read])  # (R + C, H, Dh)
    h = h + attention.wo(out.reshape(out.shape[0], attention.n_heads * attention.head_dim))  # (R + C, D)
    return h + feed_forward_rows(layer, h, grouped_moe, tuning)


def attend_chunk(
    xq: torch.Tensor,  # (C, H, Dh)
    xk: torch.Tensor,  # (C, H_kv, Dh)
    xv: torch.Tensor,  # (C, H_kv, Dh)
    layer_k: torch.Tensor,  # (R, S, H_kv, Dh) the layer's buffers, read and written
    layer_v: torch.Tensor,  # (R, S, H_kv, Dh)
    chunk,  # steps.mixed_step.PromptChunk
    visible: torch.Tensor,  # (K, P, S + P) bool: chunk_visibility
    writes: Tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # chunk_writes
) -> torch.Tensor:
    """Each chunk token over its row's slots and its prompt's chunk tokens; then writes the chunk: ``(C, H, Dh)``.

    Each segment attends in its own line of the ``(K, P)`` layout, as a batch of K: a prompt never
    reads another's keys, not even under a mask, so a NaN in one cannot spread to the others."""
    layout = (chunk.rows.shape[0], chunk.line)  # (K, P)
    where = (chunk.segment, chunk.place)

    def laid_out(x: torch.Tensor) -> torch.Tensor:  # (C, H', Dh) -> (K, P, H', Dh), zeros where no token
        return x.new_zeros(layout + x.shape[1:]).index_put(where, x)

    keys = torch.cat([layer_k[chunk.rows], laid_out(xk)], dim=1)  # (K, S + P, H_kv, Dh)
    values = torch.cat([layer_v[chunk.rows], laid_out(xv)], dim=1)
    out = F.scaled_dot_product_attention(
        laid_out(xq).transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),  # (K, H, P, Dh), (K, H_kv, S + P, Dh)
        attn_mask=visible[:, None], enable_gqa=True,  # (K, 1, P, S + P)
    )  # (K, H, P, Dh)  # fmt: skip
    rows, slots, source = writes
    write_slots(layer_k, layer_v, rows, slots, xk[source], xv[source])
    return out.transpose(1, 2)[where]  # (C, H, Dh)


def in_regions(regions: bool = True) -> bool:
    """Whether code traced now calls each block as a region (``torch.compiler.nested_compile_region``),
    where ``regions`` (``Tuning.regions``) asks for them: under ``torch.compile``, dynamo traces and
    inductor compiles a region for the first layer and calls that code for the others, whose weights
    and buffers are other tensors of the same shapes.

    The step compiles in about the time of one block, however many there are, and decodes as fast.
    Not under ``torch.export`` (the CPU step built ahead of time, ``cpu_aot_step``), whose build
    regions do not shorten and whose export they lengthen: that build is kept on disk instead. Op
    by op, regions are the plain functions. A step whose regions fail to compile (an older torch) is
    compiled with every block written out (``steps.compiler``)."""
    return regions and torch.compiler.is_compiling() and not torch.compiler.is_exporting()


def as_region(block: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``block`` as a region (``torch.compiler.nested_compile_region``, torch 2.8 and later); with an
    older torch, ``block`` itself (compiled steps then write every block out)."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    return region(block) if region is not None else block


block_region = as_region(block)


def feed_forward_rows(
    layer: TransformerBlock, h: torch.Tensor, grouped_moe: bool, tuning: Optional[Tuning] = None
) -> torch.Tensor:
    """A block's feed-forward on rows ``h (B, D)`` of one token each, in static shapes
    (``moe_one_token``, as ``tuning`` says) unless ``grouped_moe`` or the block is dense: ``(B, D)``."""
    x = layer.ffn_norm(h)
    moe = isinstance(layer.feed_forward, MoeLayer) and not grouped_moe
    return moe_one_token(layer.feed_forward, x, tuning) if moe else layer.feed_forward(x)


def choose_tokens(
    logits: torch.Tensor,  # (B, V) float
    alive: torch.Tensor,  # (B,) bool: the rows that choose a token now
    sampling: Sampling,
    uniform: Optional[torch.Tensor],  # (B,) or None when greedy
    eos_id: Optional[int],
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, logprobs, alive)`` after choosing: a row stays alive unless it chose EOS.

    ``tokens[b]`` is row b's new token and counts as generated when the returned
    ``alive[b]`` is true (an EOS ends the row and is not part of its text).
    """
    tokens = sample(logits, sampling, uniform)  # (B,)
    logprobs = token_logprobs(logits, tokens)  # (B,)
    if eos_id is not None:
        alive = alive & (tokens != eos_id)
    return tokens, logprobs, alive


NOT_EMITTED = -1  # the row had finished, or chose EOS
NOT_FINITE = -2  # the row's logits held NaN or inf


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Which rows of ``logits`` ``(N, V)`` hold no NaN or inf ``(N,)``: their largest and smallest
    values are finite (NaN propagates through both). On CPU ``isfinite(logits).all(-1)`` costs
    several times more."""
    return torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))


def emitted_tokens(
    logits: torch.Tensor, alive: torch.Tensor, tokens: torch.Tensor, next_alive: torch.Tensor
) -> torch.Tensor:
    """What the host reads of a step, ``(B,)``: the new token of each row that generated one,
    ``NOT_EMITTED`` for the others, ``NOT_FINITE`` where a running row's logits were broken
    (checked here, on the device, instead of by a sync in the loop)."""
    emitted = torch.where(next_alive, tokens, NOT_EMITTED)
    broken = alive & ~finite_rows(logits)
    return torch.where(broken, NOT_FINITE, emitted)


def make_decode_step(
    model: Transformer, greedy: bool, filtered: bool, eos_id: Optional[int], tuning: Optional[Tuning] = None,
    shaped: bool = False,
) -> Callable[..., StepOutputs]:
    """``decode_one_token`` bound to a model, to the batch's static sampling facts and to ``tuning``
    (None: the model's, ``formats.modules.tuning_of``), which compiled code reads when traced.

    ``shaped``: the step also takes the rows' logits changes (``structured.rows.Shaping.tensors``:
    a grammar's bitmask, penalties, bias, tokens left before EOS may come), fixed-shape tensors,
    applies them before sampling (``shaped_logits``; logprobs stay the model's) and returns the
    counts, seen tokens and tokens left after it as three more outputs."""
    tuning = tuning if tuning is not None else tuning_of(model)

    def decode_one_token(
        cache_k: Sequence[torch.Tensor],  # L x (B_max, S, H_kv, Dh): RotatingBufferCache.layer_keys
        cache_v: Sequence[torch.Tensor],  # L x (B_max, S, H_kv, Dh)
        tokens: torch.Tensor,  # (B,) the tokens chosen last step
        positions: torch.Tensor,  # (B,)
        alive: torch.Tensor,  # (B,) bool: rows whose last token is fed now
        uniform: Optional[torch.Tensor],  # (B,)
        temperature: torch.Tensor,  # (B,)
        top_p: torch.Tensor,  # (B,)
        top_k: torch.Tensor,  # (B,)
        *shaping: torch.Tensor,  # shaped: bits (B, W), counts (B, V), seen (B, V), presence, frequency, repetition (B,), bias (B, V), min_left (B,)
    ) -> StepOutputs:
        """Feed each alive row's token, choose its next one. Returns
        ``(tokens, logprobs, positions, alive, emitted)`` (see ``emitted_tokens``), and when shaped
        the updated ``(counts, seen, min_left)``."""
        logits = decode_logits(model, cache_k, cache_v, tokens, positions, alive, tuning=tuning)
        sampling = Sampling(temperature, top_p, top_k, greedy, filtered)
        if not shaped:
            next_tokens, logprobs, next_alive = choose_tokens(logits, alive, sampling, uniform, eos_id)
            emitted = emitted_tokens(logits, alive, next_tokens, next_alive)
            return next_tokens, logprobs, positions + alive.long(), next_alive, emitted
        bits, counts, seen, presence, frequency, repetition, bias, min_left = shaping
        chosen_from = shaped_logits(logits, eos_id, bits, counts, seen, presence, frequency, repetition, bias, min_left)
        next_tokens, _, next_alive = choose_tokens(chosen_from, alive, sampling, uniform, eos_id)
        logprobs = token_logprobs(logits, next_tokens)  # (B,) under the model
        emitted = emitted_tokens(logits, alive, next_tokens, next_alive)
        counted = (alive & next_alive).float()[:, None]  # (B, 1): a generated token, not EOS
        counts = counts.scatter_add(1, next_tokens[:, None], counted)
        repeats = (repetition != 1)[:, None] & (counted > 0)
        seen = seen.scatter(1, next_tokens[:, None], seen.gather(1, next_tokens[:, None]) | repeats)
        return next_tokens, logprobs, positions + alive.long(), next_alive, emitted, counts, seen, min_left - alive.long()

    return decode_one_token

