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
On CUDA ``StepCompiler`` also replays it as a CUDA graph.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from mixtral_infer.steps.cpu_aot_step import CPU_INDUCTOR_OPTIONS, AotStep, builds_ahead_of_time
from mixtral_infer.fast.cpu_column_blocks import ColumnBlocks
from mixtral_infer.fast.cpu_packed import PackedWeight
from mixtral_infer.fast.cpu_reductions import chosen_experts, materialized
from mixtral_infer.sampling import Sampling, sample, token_logprobs
from mixtral_infer.model.attention import one_query_sdpa
from mixtral_infer.model.cache import RotatingBufferCache
from mixtral_infer.fast.formats import expert
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.model.rope import rotary_angles
from mixtral_infer.model.transformer import Attention, Transformer, TransformerBlock
from mixtral_infer.quant.weights import QuantizedWeight

StepOutputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

# On CPU the compiled step is built by AOTInductor (``cpu_aot_step``): the same kernels as
# torch.compile's, called from a C++ wrapper instead of dynamo's and inductor's Python, 0.5-0.8 ms
# less a step (mistral-bench 8.97 against 9.74 ms in bfloat16, 4.93 against 5.61 in int8, 2-core
# AMD EPYC). False: torch.compile on CPU too (as on CUDA, where a CUDA graph removes that cost).
AHEAD_OF_TIME_ON_CPU = True


def supports_static_decode(model: Transformer) -> bool:
    """The static step runs a whole model in one process (no tensor or pipeline parallelism)."""
    return model.parallel.world_size == 1


def attend_one_token(
    attention: Attention,
    x: torch.Tensor,  # (B, D)
    rotary: Tuple[torch.Tensor, torch.Tensor],  # cos, sin: (B, 1, Dh/2)
    layer_k: torch.Tensor,  # (B_max, S, H_kv, Dh) this layer's buffers (``layer_buffers``)
    layer_v: torch.Tensor,  # (B_max, S, H_kv, Dh)
    slots: torch.Tensor,  # (B,) where each row's new key goes: position % S
    alive: torch.Tensor,  # (B,) bool: the row is decoding (a finished row writes nothing new)
    visible: torch.Tensor,  # (B, S) bool: the slots each row's query sees
) -> torch.Tensor:
    batch = x.shape[0]
    xq, xk, xv = attention.project(x, rotary)  # (B, H, Dh), (B, H_kv, Dh), (B, H_kv, Dh)
    out = attend_in_place(xq, xk, xv, layer_k, layer_v, slots, alive, visible)  # (B, H, Dh)
    return attention.wo(out.reshape(batch, attention.n_heads * attention.head_dim))  # (B, D)


def layer_buffers(buffers: torch.Tensor | Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """A cache's keys (or values) layer by layer: L buffers ``(B_max, S, H_kv, Dh)``. A whole
    ``(L, B_max, S, H_kv, Dh)`` buffer is split into its L views; a sequence of them is taken as it is.

    A compiled step takes the L views as its inputs, made outside it (``RotatingBufferCache.
    layer_keys``), and writes each in place (``write_slots``). Views made inside a compiled step are
    views of one graph input, and a write through one of them is traced as a write into a copy of
    the whole input (``select_scatter``): every layer's write would copy the whole cache (8 layers
    of a 4,096-slot bfloat16 cache, 8 KV heads of 128, compiled on CPU: 200 ms a step, against
    0.09 ms written in place)."""
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
    products. PyTorch's CPU kernel (a flash-attention kernel sized for many queries) is slow for
    one: on a 2-core AMD EPYC, bfloat16, 0.46 ms a call against 0.09 compiled (1 row, 256 slots,
    16 heads over 4 of 64: mistral-bench), 27.5 against 2.0 ms (1 row, 4,096 slots, 32 heads over
    8 of 128: the 7B shape, per layer), 236 against 19 ms (8 rows). Compiled decode batch 1 there,
    one process alternating, medians, tokens/s: mistral-bench w8a8 116.2 -> 151.5, bfloat16 67.6
    -> 77.9, float32 68.9 -> 73.0; mixtral-bench bfloat16 41.5 -> 48.5, int4 85.2 -> 105.0. Op by
    op (the eager steps) it would hold the products, so those keep the kernel, given float32
    inputs, for which it is fast (``model.attention.one_query_sdpa``)."""
    batch, n_heads, head_dim = xq.shape
    n_kv = keys.shape[2]
    q = xq.float().view(batch, 1, n_kv, n_heads // n_kv, head_dim)  # (B, 1, H_kv, G, Dh)
    scores = (q * keys.float()[:, :, :, None, :]).sum(-1) * head_dim**-0.5  # (B, S, H_kv, G)
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=1)  # over the slots
    out = (weights[..., None] * values.float()[:, :, :, None, :]).sum(1)  # (B, H_kv, G, Dh)
    return out.reshape(batch, n_heads, head_dim).to(xq.dtype)


# Plain chosen experts on CPU go one by one where an expert's matrix holds at least this many
# weights (``moe_one_token``). Read when a step is traced, so ``bench/moe_experts.py`` can build a
# copy each way (0: always; ``sys.maxsize``: never).
CPU_ONE_BY_ONE_MIN_WEIGHTS = 1 << 20

# How far the chosen experts go one by one on CPU, by the experts' kind (``cpu_experts_kind``): while
# the assignments are at most this many times the experts (``B * k <= n * E``; top-2 of 8: 2 is to
# batch 8, 1 to batch 4), every expert on every row beyond (0: only while fewer, ``B * k < E``).
# Quantized experts and large plain float32 / float16 ones to 2E, large plain bfloat16 ones to E
# (``moe_one_token`` says why). Read when a step is traced, so ``bench/moe_experts.py`` can build a
# copy each way.
CPU_CHOSEN_UP_TO = {"quantized": 2, "plain": 2, "plain bfloat16": 1}


def cpu_experts_kind(moe: MoeLayer) -> str | None:
    """The key of ``CPU_CHOSEN_UP_TO`` for these experts on CPU: "quantized"; "plain bfloat16" or
    "plain" (float32, float16) for plain experts of at least ``CPU_ONE_BY_ONE_MIN_WEIGHTS`` weights
    each; None for smaller plain experts and oneDNN-packed ones (read gathered / every expert)."""
    if isinstance(moe.w1, QuantizedWeight):
        return "quantized"
    if isinstance(moe.w1, PackedWeight) or math.prod(moe.w1.shape[1:]) < CPU_ONE_BY_ONE_MIN_WEIGHTS:
        return None
    return "plain bfloat16" if moe.w1.dtype == torch.bfloat16 else "plain"


def moe_one_token(moe: MoeLayer, x: torch.Tensor) -> torch.Tensor:
    """The mixture of experts on one token per row, x ``(B, D)``, with shapes fixed by B.

    Decoding is bound by reading weights. With ``B * k < E`` assignments only the chosen experts
    are read (batch 1, top-2 of 8: two experts); with ``B * k >= E`` nearly every expert is needed
    anyway (batch 8, top-2 of 8: 7.2 on average), so every expert runs on every row and a routing
    matrix, zero where a row did not choose the expert, mixes them: each expert's weights are
    read once, as a grouped matmul would. Both are one batched product of plain stacked experts
    (``_gathered_experts``, ``_every_expert_batched``), or loops of fixed length over 2-D weights
    through ``linear()`` for quantized or packed experts, whose kernels take one 2-D weight at a
    time (``_experts_one_by_one``, ``_every_expert_one_by_one``).

    The chosen experts go one by one on CPU too. Compiled, both forms read the experts where they
    lie (the index fused into the loops' loads), but one by one each product is
    ``cpu_reductions.rows_as_reductions``, whose loop reads a weight in several places at once from
    a row widened once, where inductor writes the gathered product as one loop over all chosen experts'
    rows, read in one place per core (mixtral-bench, compiled decode, one process alternating,
    medians of 5, tokens/s: bfloat16 batch 1 45.7 -> 52.5, batch 2 50.6 -> 58.0; float32 batch 1
    30.5 -> 32.4; ``bench/moe_experts.py``). The step takes longer to compile (mixtral-bench batch 1:
    61 s against 36 s; batch 2: 123 s against 58 s). Small experts stay gathered: where the weights
    sit in the cache, the step's time is its kernels' count (tiny-mixtral, 256 x 128 experts,
    batch 1: 3769 tokens/s gathered, 3025 one by one), hence ``CPU_ONE_BY_ONE_MIN_WEIGHTS``
    (mixtral-bench's experts are 3584 x 1024, Mixtral 8x7B's 14336 x 4096).
    Every expert on every row stays one batched product on CPU: as 8 products of 4 rows one by one,
    compiling mixtral-bench's step for batch 4 took 620 s. On CUDA the compiled gather is one
    reduction too.

    Large plain bfloat16 experts on CPU stay the chosen ones up to ``B * k = E``
    (``CPU_CHOSEN_UP_TO["plain bfloat16"]``): there both forms read E expert matrices, one row each
    or B rows each. mixtral-bench bfloat16, compiled decode, tokens/s over the batch, every expert
    (each with its own rows, ``_expert_products``) -> chosen: batch 4 33.9 -> 52.3 (the step
    compiled in 96 s -> 300 s); batch 6 66.1 -> 65.0 (53 s -> 203 s), batch 8 (2E assignments) 53.3
    -> 49.6 (35 s -> 322 s), so from there every expert. float32 and float16 experts stay the chosen
    ones up to ``B * k = 2E`` (``CPU_CHOSEN_UP_TO["plain"]``): every expert on 4 or 8 rows is one
    batched product that runs far under the bandwidth in these dtypes (bfloat16's runs on the CPU's
    AMX tiles, which this Xeon has for bfloat16 only), while one row a product reads near it:
    float32 batch 4 14.8 -> 27.5 (96 s -> 218 s), batch 8 27.6 -> 35.5 (146 s -> 380 s); float16
    batch 4 25.1 -> 61.2 (88 s -> 227 s), batch 8 49.2 -> 65.2 (43 s -> 237 s).

    Quantized experts on CPU go one by one further (``CPU_CHOSEN_UP_TO["quantized"]``): at
    ``B * k = E`` (batch 4, top-2 of 8) both forms read E expert matrices, but one row a product
    costs less arithmetic, and compiles sooner; the kernels' cost a row is such that reading the
    chosen experts still wins at ``B * k = 2E`` (batch 8: 16 expert matrices read against 8).
    mixtral-bench, compiled decode, tokens/s over the batch, every expert -> chosen
    (``bench/moe_experts.py --quantize``; ``bench/PERFORMANCE_LOG.md``): int4 batch 4 55.0 -> 76.5
    (compiled in 72 s and 47 s), batch 8 75.1 -> 88.2 (73 s, 71 s); int8 batch 4 chosen 55.5 (292
    s), batch 8 112.8 (476 s), where every expert's reductions of 4 or 8 rows compiled for over 20
    minutes, unfinished.
    """
    x = materialized(x)  # compiled on CPU: in memory, not recomputed for each row of the experts (fast.cpu_reductions)
    experts, weights = moe.route(x)  # (B, A), (B, A)
    batch, k = experts.shape
    n_experts = moe.w1.shape[0]
    two_d = isinstance(moe.w1, (QuantizedWeight, PackedWeight))  # kernels that take one 2-D weight at a time
    on_cpu = x.device.type == "cpu"
    large = math.prod(moe.w1.shape[1:]) >= CPU_ONE_BY_ONE_MIN_WEIGHTS  # (I, D): one expert's matrix
    one_by_one = two_d or (on_cpu and large)
    # the chosen experts are read while B * k <= up_to * E (and always while B * k < E)
    up_to = CPU_CHOSEN_UP_TO.get(cpu_experts_kind(moe), 0) if on_cpu else 0
    if batch * k < n_experts or batch * k <= up_to * n_experts:
        return (_experts_one_by_one if one_by_one else _gathered_experts)(moe, x, experts, weights)
    return (_every_expert_one_by_one if two_d else _every_expert_batched)(moe, x, experts, weights)


def _gathered_experts(
    moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Each row ``x (B, D)`` through its chosen ``experts (B, A)``, gathered into one batched product,
    mixed by ``weights (B, A)``: ``(B, D)``."""
    w1, w3, w2 = moe.w1[experts], moe.w3[experts], moe.w2[experts]  # (B, A, I, D), (B, A, I, D), (B, A, D, I)
    rows = x[:, None, None, :]  # (B, 1, 1, D): each row against its own A experts
    hidden = F.silu(_expert_products(rows, w1)) * _expert_products(rows, w3)  # (B, A, 1, I)
    out = _expert_products(hidden, w2)[:, :, 0]  # (B, A, D)
    return torch.einsum("bkd,bk->bd", out, weights)


def _every_expert_batched(
    moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Every expert on every row of ``x (B, D)`` as one batched product, mixed by the routing matrix."""
    mix = _routing_matrix(experts, weights, moe.w1.shape[0])  # (B, E)
    hidden = F.silu(_expert_products(x[None], moe.w1)) * _expert_products(x[None], moe.w3)  # (E, B, I)
    out = _expert_products(hidden, moe.w2)  # (E, B, D)
    return torch.einsum("ebd,be->bd", out, mix)


def _expert_products(rows: torch.Tensor, weight: torch.Tensor | ColumnBlocks) -> torch.Tensor:
    """``rows (..., N, IN)`` times ``weight (..., OUT, IN)``, each leading index its own expert:
    ``(..., N, OUT)``. Rows that several experts share (size-1 leading dimensions of ``rows``) are
    copied out to each expert first: einsum folds a broadcast dimension into the product's outputs,
    one product of all the experts side by side, which in bfloat16 on CPU ran 46x slower
    (mixtral-bench's 8 stacked w1 of 3584 x 1024 times 4 shared rows, op by op: 158 ms against 3.4
    ms with the rows copied; its compiled decode at batch 4, every expert: 1.7 -> 33.9 tokens/s,
    ``bench/PERFORMANCE_LOG.md``). A weight in column blocks ``(..., n, OUT, B)``
    (``fast.cpu_column_blocks``) is multiplied block by block, summed."""
    rows = rows.expand(*weight.shape[:-2], *rows.shape[-2:]).contiguous()  # (..., N, IN): a copy per expert
    if isinstance(weight, ColumnBlocks):
        parts = rows.unflatten(-1, (weight.blocks.shape[-3], -1))  # (..., N, n, B)
        return torch.einsum("...xnj,...ndj->...nxd", parts, weight.blocks).sum(-3)
    return torch.einsum("...xi,...di->...xd", rows, weight)


def _experts_one_by_one(
    moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``_gathered_experts`` as a loop of fixed length: the B * A chosen experts, one row each, each
    expert's 2-D weight through ``linear()`` (``moe.expert``; ``e`` a 0-d tensor, read in place).
    Compiled on CPU, inductor fuses the experts' reductions into shared loops, so they are traced
    as ``cpu_reductions.chosen_experts()``: on AMD CPUs each reads its weight in 1 place, not 2
    (mixtral-bench batch 1, one process alternating, tokens/s: bfloat16 57.4 -> 66.3, float32 41.2
    -> 46.4, int8 87.3 -> 87.6 and 101.8 -> 114.3; ``cpu_reductions``, "The chosen experts in
    fewer places")."""
    batch, k = experts.shape
    with chosen_experts():  # e: a 0-d tensor the products read; rows (N, D) -> (N, D)
        out = [sum(expert(moe, experts[b, j], x[b : b + 1]) * weights[b, j] for j in range(k)) for b in range(batch)]
    return torch.cat(out)  # (B, D)


def _every_expert_one_by_one(
    moe: MoeLayer, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``_every_expert_batched`` as a loop over the E experts, each on every row of ``x (B, D)``."""
    mix = _routing_matrix(experts, weights, moe.w1.shape[0])  # (B, E)
    return sum(expert(moe, e, x) * mix[:, e : e + 1] for e in range(moe.w1.shape[0]))


def _routing_matrix(experts: torch.Tensor, weights: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``(B, E)``: row b's mixing weight for expert e where b chose e (``experts (B, A)``), else 0."""
    mix = torch.zeros(experts.shape[0], n_experts, dtype=weights.dtype, device=weights.device)
    return mix.scatter(1, experts, weights)


def slots_and_visibility(positions: torch.Tensor, n_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row's slot ``position % S`` ``(B,)`` and the slots its query sees ``(B, S)``:
    ``j < min(position + 1, S)``. Positions ``[6, 1]``, S = 4: slots ``[2, 1]``, visible
    ``[[T, T, T, T], [T, T, F, F]]`` (the module docstring's example)."""
    slot_index = torch.arange(n_slots, device=positions.device)
    visible = slot_index[None, :] < torch.clamp(positions + 1, max=n_slots)[:, None]  # (B, S)
    return positions % n_slots, visible


def decode_logits(
    model: Transformer,
    cache_k: torch.Tensor | Sequence[torch.Tensor],  # L x (B_max, S, H_kv, Dh): layer_buffers; rows 0..B-1 are decoded
    cache_v: torch.Tensor | Sequence[torch.Tensor],  # L x (B_max, S, H_kv, Dh)
    tokens: torch.Tensor,  # (B,) each row's last token
    positions: torch.Tensor,  # (B,) the position each token takes = tokens the row has seen
    alive: torch.Tensor,  # (B,) bool
    grouped_moe: bool = False,
    regions: Optional[bool] = None,
) -> torch.Tensor:
    """Float logits ``(B, V)`` of the next token of every row; writes the alive rows' keys/values.

    ``cache_k``/``cache_v``: each layer's buffers (``layer_buffers``; compiled callers pass the
    views ``RotatingBufferCache.layer_keys``/``layer_values``). ``grouped_moe``: experts through
    ``MoeLayer.forward`` (rows grouped by expert: shapes that depend on the routing, so eager only)
    instead of ``moe_one_token``. On CPU the latter's dense case, every expert on every row, is the
    slower: one mixtral-bench layer (8 experts, top-2), 4 / 8 / 16 / 32 rows, bfloat16 packed 9.8 /
    14.3 / 22.3 / 39.5 ms against 4.8 / 8.0 / 10.6 / 14.9 ms grouped.

    Compiled, every block is one region (``decode_block``): traced and compiled once, its code
    called once a layer (``in_regions``; ``regions=False``: every block written out).
    """
    keys, values = layer_buffers(cache_k), layer_buffers(cache_v)
    slots, visible = slots_and_visibility(positions, keys[0].shape[1])
    rotary = rotary_angles(positions, model.args.head_dim, model.args.rope_theta)

    block = decode_block_region if in_regions(regions) else decode_block
    h = model.tok_embeddings(tokens)  # (B, D)
    for layer, layer_k, layer_v in zip(model.layers.values(), keys, values):
        h = block(layer, h, rotary, layer_k, layer_v, slots, alive, visible, grouped_moe)  # (B, D)
    return model.output(model.norm(h)).float()  # (B, V)


def decode_block(
    layer: TransformerBlock,
    h: torch.Tensor,  # (B, D) the residual stream
    rotary: Tuple[torch.Tensor, torch.Tensor],  # cos, sin: (B, 1, Dh/2)
    layer_k: torch.Tensor,  # (B_max, S, H_kv, Dh) this layer's buffers
    layer_v: torch.Tensor,  # (B_max, S, H_kv, Dh)
    slots: torch.Tensor,  # (B,)
    alive: torch.Tensor,  # (B,) bool
    visible: torch.Tensor,  # (B, S) bool
    grouped_moe: bool,
) -> torch.Tensor:
    """One transformer block on rows of one token each: attention in place, then the feed-forward, ``(B, D)``."""
    h = h + attend_one_token(layer.attention, layer.attention_norm(h), rotary, layer_k, layer_v, slots, alive, visible)
    return h + feed_forward_rows(layer, h, grouped_moe)


# Compiled steps trace a block once and call its code for every layer (``in_regions``). Read when a
# step is traced, so ``bench/regional_compile.py`` can build a copy each way.
REGIONS = True


def in_regions(regions: Optional[bool] = None) -> bool:
    """Whether code traced now calls each block as a region (``torch.compiler.nested_compile_region``),
    where ``regions`` (None: ``REGIONS``) asks for them:
    under ``torch.compile``, dynamo traces and inductor compiles a region for the first layer and
    calls that code for the others, whose weights and buffers are other tensors of the same shapes.

    The step compiles in about the time of one block, however many there are. ``torch.compile`` on
    a 2-core CPU, fresh inductor cache, blocks written out -> regions (``bench/regional_compile.py``):
    mistral-bench's widths with 32 layers, bfloat16 84.6 -> 15.8 s, int8 92.8 -> 21.2 s; with its 8
    layers 35.0 -> 8.5 s; mixtral-bench (8 layers) 42.7 -> 24.2 s; decoding as fast (32 layers
    bfloat16 28.8 and 29.0 tokens/s, mixtral-bench 57.9 and 60.6). Not under ``torch.export`` (the
    CPU step built ahead of time, ``cpu_aot_step``), whose build regions do not shorten and whose
    export they lengthen (8.4 s against 2.8 s with 8 layers of dim 256): that build is kept on disk
    instead. Op by op, regions are the plain functions. A step whose regions fail to compile (a torch
    older than the 2.13 they were tested with) is compiled with ``regions=False`` (``StepCompiler``)."""
    wanted = REGIONS if regions is None else regions
    return wanted and torch.compiler.is_compiling() and not torch.compiler.is_exporting()


def as_region(block: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``block`` as a region (``torch.compiler.nested_compile_region``, torch 2.8 and later); with an
    older torch, ``block`` itself (compiled steps then write every block out)."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    return region(block) if region is not None else block


decode_block_region = as_region(decode_block)


def feed_forward_rows(layer: TransformerBlock, h: torch.Tensor, grouped_moe: bool) -> torch.Tensor:
    """A block's feed-forward on rows ``h (B, D)`` of one token each, in static shapes
    (``moe_one_token``) unless ``grouped_moe`` or the block is dense: ``(B, D)``."""
    x = layer.ffn_norm(h)
    moe = isinstance(layer.feed_forward, MoeLayer) and not grouped_moe
    return moe_one_token(layer.feed_forward, x) if moe else layer.feed_forward(x)


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
    5.6x more: 32 x 2000 float32 logits, 165 against 29 us; 32 x 32000, 2.8 against 0.30 ms."""
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
    model: Transformer, greedy: bool, filtered: bool, eos_id: Optional[int], regions: Optional[bool] = None
) -> Callable[..., StepOutputs]:
    """``decode_one_token`` bound to a model and to the batch's static sampling facts (and, compiled,
    to blocks as regions or written out: ``in_regions``)."""

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
    ) -> StepOutputs:
        """Feed each alive row's token, choose its next one. Returns
        ``(tokens, logprobs, positions, alive, emitted)`` (see ``emitted_tokens``)."""
        logits = decode_logits(model, cache_k, cache_v, tokens, positions, alive, regions=regions)
        sampling = Sampling(temperature, top_p, top_k, greedy, filtered)
        next_tokens, logprobs, next_alive = choose_tokens(logits, alive, sampling, uniform, eos_id)
        emitted = emitted_tokens(logits, alive, next_tokens, next_alive)
        return next_tokens, logprobs, positions + alive.long(), next_alive, emitted

    return decode_one_token


class StepCompiler:
    """Compiled decode steps of one model, one per (batch, slots, sampling) shape, and the
    cache they decode into.

    ``torch.compile(fullgraph=True, dynamic=False)``: one graph per shape, no guard on data.
    On CPU AOTInductor builds the same graph into a library called without Python
    (``cpu_aot_step``; torch.compile where it cannot, as for w8a8 weights); the step is
    built anew when one of the weights it reads has been replaced (``AotStep.current``).
    On CUDA the graph is also captured as a CUDA graph (``triton.cudagraphs``) and the
    matrix-vector products are generated as reductions tuned by coordinate descent (what
    reads the weights at the bandwidth; gpt-fast does the same). A CUDA graph writes the
    cache at the addresses it was captured with, so the cache is marked static and kept:
    the next ``generate`` call of the same shape reuses its buffers (``cache_for``), as a
    static cache does in transformers.
    """

    def __init__(self, model: Transformer, announce: Optional[Callable[[str], None]] = None):
        self.model = model
        self.announce = announce if announce is not None else lambda message: print(message, file=sys.stderr)
        self.steps: Dict[tuple, Callable[..., StepOutputs]] = {}
        self.cache: Optional[RotatingBufferCache] = None
        self.compile_seconds = 0.0  # spent building steps so far: what a tokens/s figure should leave out

    def cache_for(self, batch: int, max_seqlen: int) -> RotatingBufferCache:
        """A cache of ``batch`` rows for sequences of up to ``max_seqlen`` tokens, reused when it fits.

        The number of slots is rounded up to a power of two (at least 128, at most the window),
        so a few shapes cover every call: each shape is one compilation, and decoding over a
        buffer at most twice the sequence reads at most twice the keys it needs.
        """
        slots = slot_bucket(max_seqlen, self.model.args.sliding_window)
        cache = self.cache
        wanted = (batch, slots, self.model.dtype, self.model.device)  # a model cast or moved since: a new one
        if cache is None or buffer_shape(cache) != wanted:
            self.cache = cache = None  # free the old buffers before making the new ones
            cache = self.model.make_cache(batch, max_seqlen=slots)
            self.cache = cache
        cache.start_sequences(batch)
        return cache

    def step(self, cache: RotatingBufferCache, batch: int, sampling: Sampling, eos_id: Optional[int]):
        """The compiled ``decode_one_token`` for this shape (compiled on its first call)."""
        if cache.cache_k.is_cuda:
            # The graph writes the cache in place at the addresses it was captured with (a cache
            # at other addresses is captured anew, not compiled anew).
            for buffer in (*cache.layer_keys, *cache.layer_values):
                torch._dynamo.mark_static_address(buffer)
        key = (batch, *buffer_shape(cache), sampling.greedy, sampling.filtered, eos_id)
        built = self.steps.get(key)
        if isinstance(built, AotStep) and not built.current():
            built = None  # a weight was replaced since it was built: it would read the old one
        if built is not None:
            return built
        self.steps.pop(key, None)

        def first_call(*args):
            """Build the step for these arguments' shapes, saying so on the terminal."""
            if key in self.steps:
                return self.steps[key](*args)
            self.announce(f"compiling the decode step for batch {batch}, {cache.cache_size} cache slots (once per shape)...")
            start = time.perf_counter()
            step = make_decode_step(self.model, sampling.greedy, sampling.filtered, eos_id)
            on_cpu = cache.cache_k.device.type == "cpu"
            built = built_ahead_of_time(self.model, step, args, self.announce) if on_cpu else None
            if built is None:
                built = compiled(step, cache.cache_k.device)
            self.steps[key] = built
            with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
                try:
                    outputs = built(*args)  # torch.compile's step compiles here
                except Exception as reason:  # before the step ran: nothing written
                    if isinstance(built, AotStep) or not REGIONS:
                        raise
                    # A torch whose regions cannot take this step (the lent GPU's is older than the
                    # one tested): every block written out, as before regions.
                    self.announce(regions_failed(reason))
                    step = make_decode_step(self.model, sampling.greedy, sampling.filtered, eos_id, regions=False)
                    built = self.steps[key] = compiled(step, cache.cache_k.device)
                    outputs = built(*args)
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            kept = isinstance(built, AotStep) and built.loaded  # built by an earlier run (cpu_aot_step.BuildCache)
            self.announce(f"compiled in {seconds:.1f}s" + (" (kept from an earlier build)" if kept else ""))
            return outputs

        return first_call


def compiled(step: Callable[..., StepOutputs], device: torch.device) -> Callable[..., StepOutputs]:
    """``step`` through ``torch.compile`` for ``device``: on CUDA replayed as a CUDA graph, its
    products tuned by coordinate descent; on CPU with the package's inductor options."""
    cuda = {"triton.cudagraphs": True, "coordinate_descent_tuning": True}
    options = cuda if device.type == "cuda" else CPU_INDUCTOR_OPTIONS
    return torch.compile(step, fullgraph=True, dynamic=False, options=options)


def regions_failed(reason: Exception) -> str:
    """The line said when a step with each block as a region fails to compile (``StepCompiler``, the
    serving engine), before it is compiled with every block written out."""
    return f"compiling each block as a region failed ({one_line(reason)}); writing blocks out"


def one_line(reason: Exception) -> str:
    """An exception as one short line: its type and the first line of its message."""
    first_line = (str(reason).strip().splitlines() or [""])[0][:200]
    return f"{type(reason).__name__}: {first_line}"


def buffer_shape(cache: RotatingBufferCache) -> tuple:
    """``(rows, slots, dtype, device)`` of a cache's buffers: what a step compiled for it assumes."""
    return cache.max_batch_size, cache.cache_size, cache.cache_k.dtype, cache.cache_k.device


def built_ahead_of_time(
    model: Transformer, step: Callable, args: Sequence, announce: Callable[[str], None]
) -> Optional[AotStep]:
    """``step`` (a fixed-shape step of ``model`` on CPU) built by AOTInductor for the shapes of
    ``args`` (``cpu_aot_step``), or None where it is not: switched off (``AHEAD_OF_TIME_ON_CPU``),
    a model whose step it does not build, or a build that failed, which ``announce`` is told in a
    line. The caller then compiles ``step`` with torch.compile."""
    if not AHEAD_OF_TIME_ON_CPU or not builds_ahead_of_time(model):
        return None
    try:
        return AotStep(model, step, args)
    except Exception as reason:  # NotAheadOfTime, or an op export or AOTInductor cannot take
        announce(f"AOTInductor cannot build this step ({one_line(reason)}); using torch.compile")
        return None


def slot_bucket(max_seqlen: int, window: Optional[int]) -> int:
    """Cache slots for sequences of up to ``max_seqlen`` tokens: the next power of two (at least
    128), capped at the sliding window. ``slot_bucket(300, 4096) == 512``, ``slot_bucket(5000, 4096) == 4096``."""
    slots = 128
    while slots < max_seqlen:
        slots *= 2
    return min(slots, window) if window is not None else slots
