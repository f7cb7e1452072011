"""``x @ weight.T`` for every matmul of the model, with few-row inputs spread over every CPU core.

Decoding multiplies one row per sequence (or the few rows an expert receives) by each weight
matrix: the time is the time to read the weights. Whether ``F.linear`` reads them from every core
depends on the CPU's library (MKL's few-row float32 path runs on one core on some CPUs), so where
``Tuning.few_row_blocks`` says so (measured once per machine, ``formats.measured``), float32 inputs of
at most ``MAX_ROWS`` rows are cut into one block of output rows per thread, run as one ``torch.bmm``;
elsewhere they go to ``F.linear``.

Example, 2 threads, weight (OUT=6, IN) and x (1, IN)::

    weight.view(2, 3, IN) @ x.T  ->  (2, 3, 1)  ->  reshape (6, 1)  ->  .T  (1, 6)

Inputs with more rows (prefill) are real matrix products and stay with ``F.linear``, as do CUDA
tensors. Op by op, bfloat16 and float16 inputs of any size stay with ``F.linear`` too: oneDNN's
few-row path already streams them from every core.

Compiled code on CPU multiplies a *plain* weight (``load_model(..., pack="columns")``, which the
CLI does for ``--decode compiled``) by a few rows of its dtype (``REDUCTION_ROWS``) as
multiply-and-sum reductions that inductor writes (``fast.cpu_reductions``), each weight read in
``Tuning.streams`` places: a loop parallel over the output rows, where inductor, left to itself,
would hand a one-row product to the library. Long rows are kept in blocks of columns
(``fast.cpu_column_blocks.ColumnBlocks``), which those reductions read block by block; other
products multiply block by block (compiled code, and float32), or the plain weight put back together
(16-bit, op by op).

A quantized weight (``quant.weights.QuantizedWeight``, int8 or int4) goes to its kernel
(``quant.kernels``), and a bfloat16/float16 weight packed in oneDNN's layout
(``fast.cpu_packed.PackedWeight``, how ``load_model`` keeps them on CPU) to oneDNN, so the
model's code has one call per matmul whatever the format. A bfloat16/float16 product of
prefill size is computed in float32 on CPUs that multiply float32 faster (``Tuning.upcast``,
``fast.cpu_upcast``), and a float32 product of prefill size by oneDNN where it beats MKL
(``Tuning.onednn_float32``, ``fast.cpu_float32``).

Each function takes the ``Tuning`` to follow (``formats.modules``' modules pass their own); without
one, ``Tuning()``'s safe defaults.
"""

from typing import List

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_column_blocks import ColumnBlocks, block_products
from mixtral_infer.fast.cpu_float32 import float32_linear
from mixtral_infer.fast.cpu_packed import PackedWeight, packed_linear, side_by_side
from mixtral_infer.fast.cpu_reductions import reduces, rows_as_reductions
from mixtral_infer.fast.cpu_upcast import should_upcast, upcast_linear
from mixtral_infer.quant.kernels import quantized_linear, quantized_linears
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning

MAX_ROWS = 8  # above this many rows, F.linear is as fast or faster
DEFAULT = Tuning()  # what a call that is given no tuning follows


@torch.compiler.assume_constant_result  # compiled code reads it once, when traced
def _threads() -> int:
    return torch.get_num_threads()


def linears(x: torch.Tensor, *weights, tuning: Tuning = DEFAULT) -> List[torch.Tensor]:
    """``[linear(x, w, tuning) for w in weights]``. Weights packed side by side
    (``cpu_packed.pack_model`` packs ``wq wk wv`` as one matrix, and ``w1 w3``) are multiplied in one
    product, then split: one call instead of three reads the weights faster (gpt-fast's fused ``wqkv``)."""
    if isinstance(weights[0], QuantizedWeight):
        return quantized_linears(x, weights, tuning)  # w8a8 weights side by side, likewise
    whole = side_by_side(weights)
    if whole is None:
        return [linear(x, weight, tuning) for weight in weights]
    return list(linear(x, whole, tuning).split([weight.shape[-2] for weight in weights], dim=-1))


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight | PackedWeight | ColumnBlocks, tuning: Tuning = DEFAULT
) -> torch.Tensor:
    """``x (M, IN) @ weight (OUT, IN).T`` -> ``(M, OUT)`` (a transposed view on the bmm path), as
    ``tuning`` says (module docstring)."""
    if isinstance(weight, QuantizedWeight):
        return quantized_linear(x, weight, tuning)
    if isinstance(weight, PackedWeight):
        if should_upcast(x, tuning.upcast):
            return upcast_linear(x, weight.dense(), tuning.onednn_float32)
        return packed_linear(x, weight)
    if isinstance(weight, ColumnBlocks):  # compiled code and float32 read the blocks; eager 16-bit the plain weight
        return column_blocks_linear(x, weight, tuning)
    if reduces(x, weight):  # compiled few-row products of a plain weight
        return rows_as_reductions(x, weight, streams=tuning.streams)
    if should_upcast(x, tuning.upcast):  # prefill-sized 16-bit products on CPUs that multiply float32 faster
        return upcast_linear(x, weight, tuning.onednn_float32)
    if x.shape[0] > MAX_ROWS and x.dtype == torch.float32:  # prompts: MKL or oneDNN, the faster here
        return float32_linear(x, weight, tuning.onednn_float32)
    if x.device.type != "cpu" or x.dtype != torch.float32 or not tuning.few_row_blocks:
        return F.linear(x, weight)
    return few_row_blocks(x, weight)


def column_blocks_linear(x: torch.Tensor, weight: ColumnBlocks, tuning: Tuning = DEFAULT) -> torch.Tensor:
    """``linear`` of a weight in blocks of columns: compiled few-row products as reductions over the
    blocks, other compiled products and float32 ones block by block (float32 sums: nothing rounded
    between blocks), eager 16-bit ones by the plain weight put back together."""
    if reduces(x, weight):
        return rows_as_reductions(x, weight.blocks, streams=tuning.streams)
    if torch.compiler.is_compiling() or x.dtype == torch.float32:
        return block_products(x, weight)
    return linear(x, weight.dense(), tuning)


def few_row_blocks(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` of a float32 CPU input of a few rows, as one ``bmm`` block of output
    rows per thread (module docstring), where the shapes allow; else ``F.linear``."""
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
        return torch.cat([few_row_blocks(x[start : start + 4], weight) for start in range(0, rows, 4)])
    if rows == 3:
        # Likewise for 3 columns: pad to 4 with a zero row and drop its result.
        return few_row_blocks(torch.cat([x, x.new_zeros(1, in_features)]), weight)[:3]
    # MKL streams the weight slower when x arrives transposed (as the (M, OUT).T views this
    # function returns do, and elementwise ops on them keep): copy the few rows first.
    x = x.contiguous()
    per_block = weight.view(blocks, out_features // blocks, in_features)  # (n, OUT/n, IN)
    y = torch.bmm(per_block, x.T.expand(blocks, in_features, rows))  # (n, OUT/n, M)
    return y.reshape(out_features, rows).T  # (M, OUT)
