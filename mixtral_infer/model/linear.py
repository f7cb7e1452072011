"""``x @ weight.T`` for the few-row inputs of decoding, spread over every CPU core.

Decoding multiplies one row per sequence (or the few rows an expert receives) by each
weight matrix: the time is the time to read the weights. On CPU, ``F.linear`` with so
few rows takes a matrix-vector path that runs on one core, reading the weights well
below the machine's memory bandwidth (measured by ``bench/``: 2.0x slower decode at
batch 1 on 2 cores). Cutting the weight into one block of output rows per thread and
running the blocks as a single ``torch.bmm`` lets every core stream its own block.

Example, 2 threads, weight (OUT=6, IN) and x (1, IN)::

    weight.view(2, 3, IN) @ x.T  ->  (2, 3, 1)  ->  reshape (6, 1)  ->  .T  (1, 6)

Inputs with more rows (prefill) are real matrix products and stay with ``F.linear``,
as do CUDA tensors and code being compiled by ``torch.compile``. So do bfloat16 and
float16: oneDNN's few-row path already streams them from every core, and the bmm blocks
run 2.5-4x slower than ``F.linear`` in bfloat16 (``bench/bench_quant.py``, 1-8 rows of a
3584 x 1024 weight on a 2-core Xeon with avx512_bf16: 0.31 ms against 0.79-1.2 ms).

A quantized weight (``quant.weights.QuantizedWeight``, int8 or int4) goes to its kernel
(``quant.kernels``), so the model's code has one call per matmul whatever the format.
"""

import torch
import torch.nn.functional as F

from mixtral_infer.quant.kernels import quantized_linear
from mixtral_infer.quant.weights import QuantizedWeight

MAX_ROWS = 8  # above this many rows, F.linear is as fast or faster (measured on 2 cores)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """``x (M, IN) @ weight (OUT, IN).T`` -> ``(M, OUT)`` (a transposed view on the bmm path)."""
    if isinstance(weight, QuantizedWeight):
        return quantized_linear(x, weight)
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.compiler.is_compiling():
        return F.linear(x, weight)  # a compiled graph picks its own matmul
    blocks = torch.get_num_threads()
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
