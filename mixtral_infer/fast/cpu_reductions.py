"""Few-row products as multiply-and-sum reductions, for compiled code on CPU.

Decoding multiplies one or two rows by each weight: the time is reading the weight. Written as
one multiply-and-sum per row, in float32, ``x (M, IN) @ weight (OUT, IN).T`` becomes in compiled
code one loop that inductor writes over the weight's rows, parallel on every thread, reading each
row of the weight once for all M rows of ``x`` and converting its 16-bit or int8 values as it
reads them (float32 ones it reads as they are). Left to itself, compiled code hands the product
to a library: oneDNN, which reorders a plain bfloat16 weight on every call, or PyTorch's int8
weight-only kernel.

2-core AMD EPYC, torch 2.13.0, 24 weights of 3584 x 1024 in turn, ms per weight:

============================================  ==========  ==========  ==========  ==========
rows (bfloat16 activations)                     1           2           4           8
============================================  ==========  ==========  ==========  ==========
reductions, plain bfloat16 weight                0.26        0.26        0.58        0.85
oneDNN's blocked layout (``fast.cpu_packed``)    0.33        0.35        0.38        0.39
``F.linear`` on the plain weight                 0.42        0.42        0.46        0.52
reductions, int8 weight (one scale a row)        0.17-0.20
PyTorch's ``_weight_int8pack_mm``                0.26-0.30
============================================  ==========  ==========  ==========  ==========

From 4 rows oneDNN's layout is faster again; but the reductions take plain weights only, which a
model keeps when it decodes compiled (``pack="columns"``), and against the products compiled code
would otherwise run on them they win further (after the norm was computed once, below). Same VM,
one weight after another, ms a weight (``bench/reduction_rows.py``,
``bench/results_reduction_rows.jsonl``):

==========================================================  ======  ======  ======  ======  ======
rows                                                          1       2       3       4       8
==========================================================  ======  ======  ======  ======  ======
float32 reductions                                           0.50    0.52    0.57    0.86    1.22
float32 bmm blocks (``fast.linear``, AMD)                   0.50    0.52    1.02    1.33    2.02
bfloat16 reductions                                          0.25    0.28    0.30    0.61    0.81
bfloat16 ``F.linear``, plain weight                          0.48    0.48    0.47    0.58    0.71
int8 reductions                                              0.15    0.20    0.23    0.33    0.54
``_weight_int8pack_mm``                                      0.29    0.31    0.33    0.40    0.87
==========================================================  ======  ======  ======  ======  ======

So ``REDUCTION_ROWS`` is 8 for float32 and int8 weights and 4 for 16-bit ones (4 rows of bfloat16
are level with ``F.linear`` in this run, 0.35 against 0.49 ms in another; in the whole model, where
the reductions read a norm's output computed once, they win every round; 8 rows of bfloat16 as
reductions lose there too: mistral-bench batch 8, 232.8 against 295.9 tokens/s).
Whole models, mistral-bench, compiled decode, a copy built with reductions for at most 2 rows (as
before) against one built with these, alternating, medians of 4, tokens/s
(``bench/results_reduction_rows_models.jsonl``): float32 batch 4 103.6 -> 167.2, batch 8 125.1 ->
186.6; bfloat16 batch 4 197.9 -> 254.3 (batch 8 unchanged: 353.8 and 360.7); int8 batch 4 267.2
-> 320.5, batch 8 242.1 -> 319.2. Batch 1 and 2, as before (below). Whole models, compiled
decode batch 1, one process alternating (medians of 3-4), tokens/s: bfloat16 plain against
packed, mistral-bench 78.5 -> 98.2, mixtral-bench 46.8 -> 61.1; int8 weight-only, reductions
against the kernel, mistral-bench 97.5 -> 114.1, mixtral-bench 54.4 -> 73.8 (w8a8, for
comparison: 163.1 and 87.2). The eager loop has no such loop to run: op by op the products would
be held in memory, and it reads the plain bfloat16 weight through ``F.linear`` (mistral-bench
57.6 packed -> 40.5 plain), so ``load_model`` packs bfloat16 unless told otherwise
(``pack="columns"``, plain but for long rows, is how ``main.py --decode compiled`` loads).

**The rows are read from memory.** Inductor inlines a cheap elementwise producer into its
consumer: the RMSNorm before wq, w1 or the output matrix would be recomputed inside the loop, for
every row of the weight (32,000 times for the output matrix), which makes the loop compute-bound.
``materialized`` keeps the rows in a float32 buffer, computed once, so the loop converts only the
weight. One bfloat16 row through a norm into a 32000 x 1024 weight, ms: int8 weight 2.81
recomputed, 1.55 in a bfloat16 buffer, 1.07 in a float32 one; bfloat16 weight 2.45, 1.86, 1.73.
(As everywhere in compiled code, the norm's result is not rounded to bfloat16 on the way, as the
op by op step rounds it: the compiled steps equal it within bfloat16's rounding, not bit for bit.)
Whole models, compiled decode batch 1, one process alternating, medians of 5, tokens/s, recomputed
-> materialized: mistral-bench int8 114.4 -> 160.1, bfloat16 95.2 -> 103.7; mixtral-bench bfloat16
64.6 -> 68.5. int8 weight-only then decodes as fast as w8a8 (fbgemm): mistral-bench 161.2 against
143.8, mixtral-bench 100.7 against 102.6 (int4: 167.5 and 95.7).

Rows longer than 2048 read at up to a third less, their float32 input no longer held in L1
beside the streaming weight: such weights are kept in blocks of columns
(``fast.cpu_column_blocks``), and the reduction runs block by block (``block_sums``).

float32 weights take the same reductions. Before, compiled float32 took ``linear()``'s bmm blocks,
which inductor also turns into a multiply-and-sum loop, but with the norm recomputed in it and
without the blocks of columns. Compiled decode batch 1, one process alternating (medians of 6),
tokens/s: mistral-wide (Mistral 7B's widths, 4 layers) 7.9 -> 9.8 (11.2 with w2 in blocks of columns);
mistral-bench 67.1 -> 69.3 and mixtral-bench 49.6 -> 51.3, within this VM's noise.

**Reading in several places.** One reduction loop reads its weight in one place: a row, then the
next. Where the weights do not fit in the cache, one such stream per core does not keep enough reads
in flight: on a 2-core Intel Xeon VM (480 MB of L3 reported, about 100 MB of it effective), int8
weights of 3584 x 1024 read at 26 GB/s while 24 of them (88 MB) are cached and at 14 GB/s when 96 of
them (352 MB) are not, though the machine streams 30 GB/s. So ``row_sums`` cuts a weight's rows into
``STREAMS`` consecutive groups, one reduction each; reading the same row, inductor fuses them into
one loop whose every step reads the weight in (up to) 8 places, each with its own sum. Same arithmetic,
same order within each sum: the results are the same bits. The 96 uncached weights, GB/s, by
places: 1 14.1, 2 18.5, 4 22.3, 8 23.4. Whole models, compiled decode, one process alternating
(medians of 5), tokens/s, 1 place -> 8 (``bench/reduction_streams.py``,
``bench/results_reduction_streams.jsonl``): mistral-bench batch 1 int8 105.2 -> 225.9; and by the
same procedure before the commit: bfloat16 60.5 -> 95.7, float32 42.1 -> 53.2; batch 4 int8 234.1
-> 384.1, bfloat16 166.0 -> 236.6; batch 8 float32 200.6 -> 211.4; mixtral-bench batch 1 int8 69.7
-> 105.4. More places read no faster: Mistral 7B's widths (mistral-wide, int8, 1 GB a step, batch 1),
8 places 25.2 tokens/s, 16 places 24.5 (same script and file).

**Fewer places on AMD.** On a 2-core Zen 4 AMD EPYC (torch 2.13.0) the same whole-model measurement
goes the other way: more places read slower. ``bench/reduction_streams.py`` (and a scratch copy of it),
compiled decode batch 1, one process alternating 5-7 rounds, medians, tokens/s, 8 places -> 1 -> 2:

=================================  ==========  ==========  ==========
model, dtype                        8           1           2
=================================  ==========  ==========  ==========
mixtral-bench bfloat16               60.0        82.3        (4: 57.8)
mixtral-bench bfloat16 (again)       44.7        58.4        55.5
mixtral-bench bfloat16 (script)      45.4        61.3        55.1
mixtral-bench int8                   74.0        93.7        92.8
mixtral-bench float32                33.8        35.8        37.2
mistral-bench bfloat16               92.1        100.0       106.5
mistral-bench int8                   149.4       152.3       180.7
mistral-bench float32                58.7        65.3        68.7
=================================  ==========  ==========  ==========

So AMD CPUs read in 2 places (``VENDOR_STREAMS``), Intel ones in 8 as above: 2 is best or level on
every row but mixtral-bench bfloat16, where 1 is faster still (next paragraph). The weights alone
(``bench/fused_places.py``: one bfloat16 row times 3584 x 1024 weights, 1 or 2 of them per loop,
GB/s by places 1 / 2 / 4 / 8): one per loop 22.4 / 22.1 / 22.2 / 20.1, two per loop 24.7 / 24.6 /
22.6 / 18.7 (``bench/results_fused_places.jsonl``): the fewer places a loop reads in all, the faster,
down to 2-4. At batch 4 (mistral-bench, 3 rounds, ``--streams 2 8 --batch 4``) 2 places are level
with 8: bfloat16 234.4 against 232.4 tokens/s, int8 347.8 against 361.5 (2 of 3 rounds won by 2).
Not measured: other AMD generations, Intel client CPUs.

**The chosen experts in fewer places.** A Mixtral's chosen experts read the same row, and inductor
fuses their loops: the w1 and w3 of both experts in one loop, 4 weights in 2 places each (8 sums
over a quarter of the rows, in the generated code of a tiny Mixtral with ``EXPERT_STREAMS = 2``;
1 place: 4 sums over all of them). So the
experts' products are traced inside ``chosen_experts()`` (``decode_step._experts_one_by_one``), and
on the vendors in ``VENDOR_EXPERT_STREAMS`` (AMD: 1) read in that many places; every other product,
and Intel's experts, as before. Zen 4, mixtral-bench, compiled decode, copies whose experts read in
2 places and in 1 (``bench/reduction_streams.py --experts``), alternating, medians, tokens/s:

=================================  ==========  ==========  ==============
model, dtype, batch                 2 places    1 place     rounds 1 won
=================================  ==========  ==========  ==============
bfloat16, batch 1 (scratch copy)     55.7        61.4        3 of 5
bfloat16, batch 1 (1 loaded first)   62.3        60.7        4 of 5
bfloat16, batch 1                    57.4        66.3        6 of 7
bfloat16, batch 2                    63.8        65.6        5 of 5
int8, batch 1 (scratch copy)         101.8       114.3       5 of 5
int8, batch 1                        87.3        87.6        3 of 5
float32, batch 1 (scratch copy)      39.2        42.8        5 of 5
float32, batch 1                     41.2        46.4        5 of 5
=================================  ==========  ==========  ==============

**Small weights in fewer places.** Each place is a sum per row of ``x`` in the loop inductor writes
and compiles, and a weight that sits in the cache gains nothing from being read in several: places
come in groups of at least ``MIN_GROUP_ROWS`` (32) rows. Every weight of Mistral 7B, Mixtral 8x7B
and the bench shapes has 256 rows or more, and is read in as many places as before (8 on Intel);
with 8, the shipped tiny models' 64-128-row weights in 2-4, the test models' in 1-4. 2-core Zen 4
EPYC (with 8 places), compiled decode, build with an empty compile cache and best of 3 x 200
tokens, groups of 8 -> 32 rows, two runs each:
tiny-mistral bfloat16 33.1 / 31.5 -> 30.2 / 29.7 s, 4652 / 3508 -> 5212 / 5233 tokens/s;
tiny-mixtral bfloat16 28.8 / 27.4 -> 26.1 / 26.0 s, 4451 / 3432 -> 4293 / 4902 tokens/s. The test
suite with an empty compile cache: 10:45 -> 9:32 (one int8 AOTInductor test 58 -> 30 s alone).

Example, one row times a 3 x 2 weight: ``[1, 2] @ [[1, 0], [0, 1], [1, 1]].T`` is the three sums
``[1*1 + 2*0, 1*0 + 2*1, 1*1 + 2*1] = [1, 2, 3]``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from mixtral_infer.hardware import cpu_info

# Compiled products of at most this many rows are reductions, by the weight's dtype (the docstring's
# second table): float32 and int8 to 8 rows, 16-bit to 4.
REDUCTION_ROWS = {torch.float32: 8, torch.int8: 8, torch.bfloat16: 4, torch.float16: 4}
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# A weight's rows are read in up to this many places at once (``row_sums``; module docstring,
# "Reading in several places"), by the CPU's vendor: 8 on Intel CPUs (and unknown ones), 2 on AMD
# ones, which read slower from more ("Fewer places on AMD"). ``STREAMS`` forces a number (None: by
# vendor, ``max_streams``).
VENDOR_STREAMS = {"AuthenticAMD": 2}
DEFAULT_STREAMS = 8
STREAMS: Optional[int] = None
# The chosen experts' products (traced inside ``chosen_experts()``) read the same row, and inductor
# fuses the experts' loops into one: on the vendors listed here each reads in this many places instead
# ("The chosen experts in fewer places"); elsewhere as every product. ``EXPERT_STREAMS`` forces a
# number for them (None: ``STREAMS`` where set, else by vendor).
VENDOR_EXPERT_STREAMS = {"AuthenticAMD": 1}
EXPERT_STREAMS: Optional[int] = None
_tracing_experts = False  # True inside ``chosen_experts()``
# ... but only in groups of at least this many rows (``streams``): every weight of the real shapes
# has 256 or more rows, so is read in all of them; a smaller weight sits in the cache, where more
# places gain nothing and each is one more sum per row to generate and compile (module docstring,
# "Small weights").
MIN_GROUP_ROWS = 32


def rows_as_reductions(x: torch.Tensor, weight: torch.Tensor, scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x (M, IN) @ weight (OUT, IN).T`` -> ``(M, OUT)``, one multiply-and-sum per row of ``x`` in
    float32, times ``scales (OUT,)`` when given (an int8 weight's), rounded once to ``x``'s dtype.
    ``weight`` may also be column blocks ``(n, OUT, B)`` (``fast.cpu_column_blocks``): then each
    block's sums, in turn, are added up. Op by op it would hold ``(OUT, IN)`` float32 products:
    for compiled code only."""
    wide = weight.float()  # (OUT, IN) or (n, OUT, B): inductor converts as it reads, nothing is stored
    rows = materialized(x.float())  # (M, IN) widened once, not once per row of the weight
    if wide.dim() == 3:  # block by block, each its own reduction against its piece of the row
        sums = torch.stack([block_sums(row, wide) for row in rows.unbind(0)])
    else:
        sums = torch.stack([row_sums(row, wide) for row in rows.unbind(0)])  # (M, OUT)
    if scales is not None:
        sums = sums * scales.float()
    return sums.to(x.dtype)


def row_sums(row: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``row (IN,) @ weight (OUT, IN).T`` -> ``(OUT,)``, as ``k`` reductions over consecutive groups
    of the weight's rows (``k``: ``streams(OUT)``), joined in order. Each sum is the one
    ``(row * weight).sum(-1)`` makes, added in the same order; but inductor puts the ``k`` reductions,
    which read the same ``row``, into one loop over ``OUT / k`` rows, so every step of it reads the
    weight in ``k`` places, each with a sum of its own (module docstring: "Reading in several places").

    Example, ``k = 2``, weight rows ``w0..w3``: one loop over 2 rows, whose step ``i`` reads rows
    ``i`` and ``2 + i``; the result is ``[row @ w0, row @ w1, row @ w2, row @ w3]``."""
    k = streams(weight.shape[0])
    if k == 1:
        return (row * weight).sum(-1)
    groups = weight.reshape(k, weight.shape[0] // k, weight.shape[1])  # (k, OUT / k, IN)
    return torch.cat([(row * group).sum(-1) for group in groups.unbind(0)])  # (OUT,)


def streams(out: int) -> int:
    """How many places ``row_sums`` reads a weight of ``out`` rows in: the largest power of two up to
    ``max_streams()`` that divides ``out`` into groups of at least ``MIN_GROUP_ROWS`` rows (with 8:
    256 -> 8, 32000 -> 8, 128 -> 4, 96 -> 2, 48 -> 1, 7 -> 1). A few rows (the MoE router's 8) are
    read in one place: reading them is no time, and inductor would fold the norm before them into a
    loop of single-row sums."""
    k = max_streams()
    while k > 1 and (out % k or out // k < MIN_GROUP_ROWS):
        k //= 2
    return k


def max_streams() -> int:
    """``STREAMS`` where set, else this CPU vendor's number: ``VENDOR_STREAMS``, or ``DEFAULT_STREAMS``
    for a vendor not in it. Inside ``chosen_experts()``: ``EXPERT_STREAMS`` where set, else as
    outside but for the vendors in ``VENDOR_EXPERT_STREAMS`` (AMD: 1)."""
    if _tracing_experts and EXPERT_STREAMS is not None:
        return EXPERT_STREAMS
    if STREAMS is not None:
        return STREAMS
    return _vendor_expert_streams() if _tracing_experts else _vendor_streams()


@torch.compiler.assume_constant_result  # compiled code reads it once, when traced
def _vendor_streams() -> int:
    return VENDOR_STREAMS.get(cpu_info().vendor, DEFAULT_STREAMS)


@torch.compiler.assume_constant_result
def _vendor_expert_streams() -> int:
    return VENDOR_EXPERT_STREAMS.get(cpu_info().vendor, _vendor_streams())


@contextmanager
def chosen_experts():
    """The products traced inside are the chosen experts' of one step (``decode_step``), which
    inductor fuses into shared loops: they read in ``max_streams()``'s experts' number of places.
    A setting read when code is traced (by ``torch.compile`` or ``torch.export``), like ``STREAMS``:
    it changes the generated loops, not the products' values."""
    global _tracing_experts
    outer, _tracing_experts = _tracing_experts, True
    try:
        yield
    finally:
        _tracing_experts = outer


def block_sums(row: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``row (IN,) @ blocks (n, OUT, B)`` -> ``(OUT,)``: the ``n`` blocks' sums, in turn, added up.
    One reduction per block, each parallel over the weight's rows as a plain weight's is: one
    reduction over all ``(n, OUT, B)`` is shared out by inductor over the ``n`` blocks instead, so
    7 blocks on 2 cores leave one idle for a block (int8, 14336 columns in blocks of 2048, 2-core
    AMD EPYC: 19.1 GB/s against 22.0 block by block; 2 blocks of 1792: 21.8 against 22.8)."""
    sums = [row_sums(piece, block) for piece, block in zip(row.view(blocks.shape[0], -1), blocks)]  # n x (OUT,)
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
    for every layer (``decode_step.decode_block``)."""
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
