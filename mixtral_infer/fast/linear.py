"""``x @ weight.T`` for every matmul of the model, with few-row inputs spread over every CPU core.

Decoding multiplies one row per sequence (or the few rows an expert receives) by each
weight matrix: the time is the time to read the weights. Whether ``F.linear`` reads them
from every core depends on the CPU (MKL's few-row float32 path), so this module measures
the difference once per CPU vendor and picks (torch 2.13.0, 2 cores, 3584 x 1024 float32):

========================================  ==============================  ==========================
1-3 rows                                   2-core AMD EPYC (avx512_bf16)   2-core Intel Xeon (SPR)
========================================  ==============================  ==========================
``F.linear``                               one core                        both cores, 25-29 GB/s
one ``bmm`` block per thread (below)       42 GB/s, step 51-59 -> 27 ms    one core, 15-16 GB/s
========================================  ==============================  ==========================

So on AMD CPUs (``hardware.cpu_info().vendor == "AuthenticAMD"``) float32 inputs of at most
``MAX_ROWS`` rows are cut into one block of output rows per thread, run as one ``torch.bmm``;
elsewhere they go to ``F.linear`` (on the Xeon: mistral-bench float32 decode 24 -> 42 tokens/s).
``split_few_rows`` overrides the choice (True/False; None = by vendor).

Example, 2 threads, weight (OUT=6, IN) and x (1, IN)::

    weight.view(2, 3, IN) @ x.T  ->  (2, 3, 1)  ->  reshape (6, 1)  ->  .T  (1, 6)

Inputs with more rows (prefill) are real matrix products and stay with ``F.linear``,
as do CUDA tensors. Code being compiled by ``torch.compile`` (the static decode step) takes
the same blocks, where inductor does not call ``bmm`` at all: a product with one column
becomes its own multiply-and-sum loop, parallel over the output rows, so both cores read the
weight. Left to itself it hands a one-row ``F.linear`` to the library's ``mm`` (one core, as
above). 2-core AMD EPYC, compiled decode batch 1, float32, one process alternating the two
(6 / 4 rounds, medians): mistral-bench 27.3 -> 64.1 tokens/s, mixtral-bench 26.5 -> 31.1.
Op by op, bfloat16 and float16 inputs of any size stay with ``F.linear``: oneDNN's few-row path
already streams them from every core, and the bmm blocks run 2.5-4x slower than ``F.linear``
in bfloat16 (``bench/bench_quant.py``, 1-8 rows of a 3584 x 1024 weight on a 2-core Xeon
with avx512_bf16: 0.31 ms against 0.79-1.2 ms).

Compiled code on CPU multiplies a *plain* weight (``load_model(..., pack="columns")``, which the
CLI does for ``--decode compiled``) by a few rows of its dtype (``REDUCTION_ROWS``: up to 8 of
float32, 4 of 16-bit) as multiply-and-sum reductions that inductor writes
(``fast.cpu_reductions``): bfloat16 and float16 faster than oneDNN reads its own layout, float32
faster than the bmm blocks above (which remain the eager path's). Rows longer than 2048 are kept
in blocks of columns (``fast.cpu_column_blocks.ColumnBlocks``), which those reductions read block
by block; other products multiply block by block (compiled code, and float32), or the plain weight
put back together (16-bit, op by op).

A quantized weight (``quant.weights.QuantizedWeight``, int8 or int4) goes to its kernel
(``quant.kernels``), and a bfloat16/float16 weight packed in oneDNN's layout
(``fast.cpu_packed.PackedWeight``, how ``load_model`` keeps them on CPU) to oneDNN, so the
model's code has one call per matmul whatever the format. A bfloat16/float16 product of
prefill size is computed in float32 on CPUs that multiply float32 faster (``fast.cpu_upcast``),
and a float32 product of prefill size by oneDNN where it beats MKL (``fast.cpu_float32``).
"""

from typing import List

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_column_blocks import ColumnBlocks, block_products
from mixtral_infer.fast.cpu_float32 import float32_linear
from mixtral_infer.fast.cpu_packed import PackedWeight, packed_linear, side_by_side
from mixtral_infer.fast.cpu_reductions import reduces, rows_as_reductions
from mixtral_infer.fast.cpu_upcast import should_upcast, upcast_linear
from mixtral_infer.hardware import cpu_info
from mixtral_infer.quant.kernels import quantized_linear, quantized_linears
from mixtral_infer.quant.weights import QuantizedWeight

MAX_ROWS = 8  # above this many rows, F.linear is as fast or faster (measured on 2 cores)
split_few_rows = None  # True / False forces the bmm blocks on / off; None: on for AMD CPUs only


@torch.compiler.assume_constant_result  # compiled code reads it once, when traced
def _threads() -> int:
    return torch.get_num_threads()


@torch.compiler.assume_constant_result
def _amd_cpu() -> bool:
    return cpu_info().vendor == "AuthenticAMD"


def _split_few_rows() -> bool:
    return _amd_cpu() if split_few_rows is None else split_few_rows


def linears(x: torch.Tensor, *weights) -> List[torch.Tensor]:
    """``[linear(x, w) for w in weights]``. Weights packed side by side (``cpu_packed.pack_model``
    packs ``wq wk wv`` as one matrix, and ``w1 w3``) are multiplied in one product, then split:
    one call instead of three reads the weights faster (gpt-fast's fused ``wqkv``; one bfloat16
    mistral-bench layer's wq wk wv w1 w3 for one row, 16 layers in turn on the 2-core Xeon: 0.89
    ms one by one, 0.79 ms side by side)."""
    if isinstance(weights[0], QuantizedWeight):
        return quantized_linears(x, weights)  # w8a8 weights side by side, likewise
    whole = side_by_side(weights)
    if whole is None:
        return [linear(x, weight) for weight in weights]
    return list(linear(x, whole).split([weight.shape[-2] for weight in weights], dim=-1))


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight | PackedWeight | ColumnBlocks) -> torch.Tensor:
    """``x (M, IN) @ weight (OUT, IN).T`` -> ``(M, OUT)`` (a transposed view on the bmm path)."""
    if isinstance(weight, QuantizedWeight):
        return quantized_linear(x, weight)
    if isinstance(weight, PackedWeight):
        return upcast_linear(x, weight.dense()) if should_upcast(x) else packed_linear(x, weight)
    if isinstance(weight, ColumnBlocks):  # compiled code and float32 read the blocks; eager 16-bit the plain weight
        if reduces(x, weight):
            return rows_as_reductions(x, weight.blocks)
        if torch.compiler.is_compiling() or x.dtype == torch.float32:  # float32 sums: nothing rounded between blocks
            return block_products(x, weight)
        return linear(x, weight.dense())
    if reduces(x, weight):  # compiled few-row products of a plain weight
        return rows_as_reductions(x, weight)
    if should_upcast(x):  # prefill-sized 16-bit products on CPUs that multiply float32 faster
        return upcast_linear(x, weight)
    if x.shape[0] > MAX_ROWS and x.dtype == torch.float32:  # prompts: MKL or oneDNN, the faster here
        return float32_linear(x, weight)
    if x.device.type != "cpu" or x.dtype != torch.float32 or not _split_few_rows():
        return F.linear(x, weight)
    blocks = _threads()
    rows, (out_features, in_features) = x.shape[0], weight.shape
    if (
        x.dim() != 2
        or rows > MAX_ROWS
        or blocks < 2
        or out_features % blocks
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight)
    if rows > 4:
        # MKL reads the weight slower for 5-8 columns than in two passes of at most 4.
        return torch.cat([linear(x[start : start + 4], weight) for start in range(0, rows, 4)])
    if rows == 3:
        # Likewise for 3 columns: pad to 4 with a zero row and drop its result.
        return linear(torch.cat([x, x.new_zeros(1, in_features)]), weight)[:3]
    # MKL streams the weight 3-4x slower when x arrives transposed (as the (M, OUT).T views this
    # function returns do, and elementwise ops on them keep): copy the few rows first.
    x = x.contiguous()
    per_block = weight.view(blocks, out_features // blocks, in_features)  # (n, OUT/n, IN)
    y = torch.bmm(per_block, x.T.expand(blocks, in_features, rows))  # (n, OUT/n, M)
    return y.reshape(out_features, rows).T  # (M, OUT)
