"""Few-row products as multiply-and-sum reductions, for compiled code on CPU.

Decoding multiplies one or two rows by each weight: the time is reading the weight. Written as
one multiply-and-sum per row, in float32, ``x (M, IN) @ weight (OUT, IN).T`` becomes in compiled
code one loop that inductor writes over the weight's rows, parallel on every thread, reading each
row of the weight once for all M rows of ``x`` and converting its 16-bit or int8 values as it
reads them (float32 ones it reads as they are). Left to itself, compiled code hands the product
to a library: oneDNN, which reorders a plain bfloat16 weight on every call, or PyTorch's int8
weight-only kernel, both slower at these few rows.

Up to ``REDUCTION_ROWS`` rows of the weight's dtype are multiplied so: from there a library's
product reads the weight as fast and computes less. The reductions take plain weights only, which a
model keeps when it decodes compiled (``load_model(..., pack="columns")``). The eager loop has no
such loop to run: op by op the products would be held in memory.

**The rows are read from memory.** Inductor inlines a cheap elementwise producer into its
consumer: the RMSNorm before wq, w1 or the output matrix would be recomputed inside the loop, for
every row of the weight, which makes the loop compute-bound. ``materialized`` keeps the rows in a
float32 buffer, computed once, so the loop converts only the weight. (As everywhere in compiled
code, the norm's result is not rounded to bfloat16 on the way, as the op by op step rounds it: the
compiled steps equal it within bfloat16's rounding, not bit for bit.)

Rows longer than ``fast.cpu_column_blocks.MAX_BLOCK`` read slower, their float32 input no longer held
in L1 beside the streaming weight: such weights are kept in blocks of columns, and the reduction
runs block by block (``block_sums``).

**Reading in several places.** One reduction loop reads its weight in one place: a row, then the
next. Where the weights do not fit in the cache, one such stream per core may not keep enough reads
in flight to fill the memory's bandwidth. So ``row_sums`` cuts a weight's rows into ``streams``
consecutive groups (``Tuning.streams``), one reduction each; reading the same row, inductor fuses
them into one loop whose every step reads the weight in that many places, each with its own sum.
Same arithmetic, same order within each sum: the results are the same bits. How many places read
fastest depends on the machine: on some more places read slower.

**The chosen experts.** A Mixtral's chosen experts read the same row, and inductor fuses their loops:
the w1 and w3 of both experts in one loop, 4 weights in ``k`` places each. So the experts' products
take their own number of places (``Tuning.expert_streams``, passed down by
``kernels.moe.one_by_one``).

**Small weights in fewer places.** Each place is a sum per row of ``x`` in the loop inductor writes
and compiles, and a weight that sits in the cache gains nothing from being read in several: places
come in groups of at least ``MIN_GROUP_ROWS`` rows (``places``). Every weight of Mistral 7B and
Mixtral 8x7B has 1024 rows or more and is read in all of them; the tiny test models' in fewer.

Example, one row times a 3 x 2 weight: ``[1, 2] @ [[1, 0], [0, 1], [1, 1]].T`` is the three sums
``[1*1 + 2*0, 1*0 + 2*1, 1*1 + 2*1] = [1, 2, 3]``.
"""

from __future__ import annotations

from typing import Optional

import torch

# Compiled products of at most this many rows are reductions, by the weight's dtype: float32 and
# int8 to 8 rows, 16-bit to 4 (from there a library's product is as fast).
REDUCTION_ROWS = {torch.float32: 8, torch.int8: 8, torch.bfloat16: 4, torch.float16: 4}
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
STREAMS = 8  # the places a weight is read in when none is said (``Tuning.streams``' default)
# Places come in groups of at least this many rows (``places``; module docstring, "Small weights").
MIN_GROUP_ROWS = 32


def rows_as_reductions(
    x: torch.Tensor, weight: torch.Tensor, scales: Optional[torch.Tensor] = None, streams: int = STREAMS
) -> torch.Tensor:
    """``x (M, IN) @ weight (OUT, IN).T`` -> ``(M, OUT)``, one multiply-and-sum per row of ``x`` in
    float32, times ``scales (OUT,)`` when given (an int8 weight's), rounded once to ``x``'s dtype;
    each weight read in up to ``streams`` places (``row_sums``). ``weight`` may also be column blocks
    ``(n, OUT, B)`` (``fast.cpu_column_blocks``): then each block's sums, in turn, are added up. Op by
    op it would hold ``(OUT, IN)`` float32 products: for compiled code only."""
    wide = weight.float()  # (OUT, IN) or (n, OUT, B): inductor converts as it reads, nothing is stored
    rows = materialized(x.float())  # (M, IN) widened once, not once per row of the weight
    if wide.dim() == 3:  # block by block, each its own reduction against its piece of the row
        sums = torch.stack([block_sums(row, wide, streams) for row in rows.unbind(0)])
    else:
        sums = torch.stack([row_sums(row, wide, streams) for row in rows.unbind(0)])  # (M, OUT)
    if scales is not None:
        sums = sums * scales.float()
    return sums.to(x.dtype)


def row_sums(row: torch.Tensor, weight: torch.Tensor, streams: int = STREAMS) -> torch.Tensor:
    """``row (IN,) @ weight (OUT, IN).T`` -> ``(OUT,)``, as ``k`` reductions over consecutive groups
    of the weight's rows (``k``: ``places(OUT, streams)``), joined in order. Each sum is the one
    ``(row * weight).sum(-1)`` makes, added in the same order; but inductor puts the ``k`` reductions,
    which read the same ``row``, into one loop over ``OUT / k`` rows, so every step of it reads the
    weight in ``k`` places, each with a sum of its own (module docstring: "Reading in several places").

    Example, ``k = 2``, weight rows ``w0..w3``: one loop over 2 rows, whose step ``i`` reads rows
    ``i`` and ``2 + i``; the result is ``[row @ w0, row @ w1, row @ w2, row @ w3]``."""
    k = places(weight.shape[0], streams)
    if k == 1:
        return (row * weight).sum(-1)
    groups = weight.reshape(k, weight.shape[0] // k, weight.shape[1])  # (k, OUT / k, IN)
    return torch.cat([(row * group).sum(-1) for group in groups.unbind(0)])  # (OUT,)


def places(out: int, streams: int = STREAMS) -> int:
    """How many places ``row_sums`` reads a weight of ``out`` rows in: the largest power of two up to
    ``streams`` that divides ``out`` into groups of at least ``MIN_GROUP_ROWS`` rows (with 8:
    256 -> 8, 32000 -> 8, 128 -> 4, 96 -> 2, 48 -> 1, 7 -> 1). A few rows (the MoE router's 8) are
    read in one place: reading them is no time, and inductor would fold the norm before them into a
    loop of single-row sums."""
    k = 1
    while k * 2 <= streams:
        k *= 2
    while k > 1 and (out % k or out // k < MIN_GROUP_ROWS):
        k //= 2
    return k


def block_sums(row: torch.Tensor, blocks: torch.Tensor, streams: int = STREAMS) -> torch.Tensor:
    """``row (IN,) @ blocks (n, OUT, B)`` -> ``(OUT,)``: the ``n`` blocks' sums, in turn, added up.
    One reduction per block, each parallel over the weight's rows as a plain weight's is: one
    reduction over all ``(n, OUT, B)`` is shared out by inductor over the ``n`` blocks instead, so
    7 blocks on 2 cores would leave one core idle for a block."""
    pieces = zip(row.view(blocks.shape[0], -1), blocks)
    sums = [row_sums(piece, block, streams) for piece, block in pieces]  # n x (OUT,)
    return sum(sums[1:], sums[0])  # in block order


def reduces(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether compiled code multiplies ``x`` by ``weight`` (a plain weight of ``x``'s float dtype,
    or int8 integers) as ``rows_as_reductions``: on CPU, 1 to ``REDUCTION_ROWS[weight.dtype]`` rows."""
    return (
        x.device.type == "cpu"
        and x.dtype in FLOAT_DTYPES
        and weight.dtype in (x.dtype, torch.int8)
        and x.dim() == 2
        and 1 <= x.shape[0] <= reduction_rows(weight.dtype)
        and torch.compiler.is_compiling()
    )


@torch.compiler.assume_constant_result
def reduction_rows(dtype: torch.dtype) -> int:
    """``REDUCTION_ROWS[dtype]``, read when code is traced and taken as a constant there: a guard on
    the dict's item (keyed by a dtype) is one dynamo cannot check when it reuses a compiled region
    for every layer (``decode_step.block``)."""
    return REDUCTION_ROWS[dtype]


def materialized(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself; in compiled CPU code, held in a buffer of its own rather than recomputed by each
    consumer (module docstring). ``prims.inductor_force_stride_order`` is how inductor itself asks
    for a buffer of given strides; ``torch.compile`` registers it."""
    if x.device.type != "cpu" or not torch.compiler.is_compiling():
        return x
    return torch.ops.prims.inductor_force_stride_order(x, x.stride())


def expert_of(stacked, e):
    """Expert ``e`` of stacked weights ``(E, ...)``: ``stacked[e]``, a view (or, for a tensor ``e`` of
    several experts, a gathered copy). In compiled code, where ``e`` is a 0-d tensor (the step's
    routing), a plain tensor is indexed by ``index_select`` instead: inductor then loads through
    the index inside the product's loop, so the reduction reads the expert where it lies (no
    copy), and ``torch.compile`` has no host value to ask for (``stacked[e]`` becomes a select at a
    data-dependent index, which it cannot trace). Quantized and packed weights index themselves."""
    one = isinstance(e, torch.Tensor) and e.dim() == 0
    if one and isinstance(stacked, torch.Tensor) and torch.compiler.is_compiling():
        return stacked.index_select(0, e.reshape(1))[0]
    return stacked[e]
