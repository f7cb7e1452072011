"""Plain float weights: ``x @ weight.T`` with few-row inputs spread over every CPU core.

Decoding multiplies one row per sequence (or the few rows an expert receives) by each weight
matrix: the time is the time to read the weights. Whether ``F.linear`` reads them from every core
depends on the CPU's library (MKL's few-row float32 path runs on one core on some CPUs), so where
``Tuning.few_row_blocks`` says so (measured once per machine, ``formats.measured``), float32 inputs of
at most ``MAX_ROWS`` rows are cut into one block of output rows per thread, run as one ``torch.bmm``;
elsewhere they go to ``F.linear``.

Example, 2 threads, weight (OUT=6, IN) and x (1, IN)::

    weight.view(2, 3, IN) @ x.T  ->  (2, 3, 1)  ->  reshape (6, 1)  ->  .T  (1, 6)

Ahead of those blocks, where ``Tuning.float_dots`` says so (the machine measured it faster, and the
package's library builds there: ``kernels.native``), float32 inputs of at most ``MAX_ROWS`` rows go to
the package's own product, ``kernels/float_dots.cpp``, which reads the weight once for all the rows
(``float_dots``); where ``Tuning.bfloat16_dots`` says so, bfloat16 ones too (``bfloat16_dots``: the
weight widened in registers, float32 sums), on CPUs whose library multiplies bfloat16 under the speed
of reading it.

Inputs with more rows (prefill) are real matrix products and stay with ``F.linear``, as do CUDA
tensors. Op by op, other bfloat16 and float16 inputs of any size stay with ``F.linear`` too.

Compiled code on CPU multiplies a *plain* weight (``load_model(..., pack="columns")``, which the
CLI does for ``--decode compiled``) by a few rows of its dtype (``REDUCTION_ROWS``) as
multiply-and-sum reductions that inductor writes (``fast.cpu_reductions``), each weight read in
``Tuning.streams`` places: a loop parallel over the output rows, where inductor, left to itself,
would hand a one-row product to the library (long rows kept in blocks of columns are
``column_blocks``' weights).

A 16-bit product of prefill size is computed in float32 on CPUs that multiply float32 faster
(``Tuning.upcast``, ``fast.cpu_upcast``), and a float32 one by oneDNN where it beats MKL
(``Tuning.onednn_float32``, ``fast.cpu_float32``).
"""

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_float32 import float32_linear
from mixtral_infer.fast.cpu_reductions import reduces, rows_as_reductions
from mixtral_infer.fast.cpu_upcast import should_upcast, upcast_linear
from mixtral_infer.kernels import native
from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend
from mixtral_infer.tuning import Tuning

MAX_ROWS = 8  # above this many rows, F.linear is as fast or faster


@torch.compiler.assume_constant_result  # compiled code reads it once, when traced
def _threads() -> int:
    return torch.get_num_threads()


class PlainLinear(LinearBackend):
    """A float ``nn.Parameter`` ``(OUT, IN)`` (module docstring)."""

    @classmethod
    def reads(cls, weight: object) -> bool:
        return isinstance(weight, torch.Tensor)

    @staticmethod
    def product(x: torch.Tensor, weight: torch.Tensor, tuning: Tuning = DEFAULT) -> torch.Tensor:
        """``x (M, IN) @ weight (OUT, IN).T`` -> ``(M, OUT)`` (a transposed view on the bmm path)."""
        if reduces(x, weight):  # compiled few-row products
            return rows_as_reductions(x, weight, streams=tuning.streams)
        if should_upcast(x, tuning.upcast):  # prefill-sized 16-bit products on CPUs that multiply float32 faster
            return upcast_linear(x, weight, tuning.onednn_float32)
        if x.shape[0] > MAX_ROWS and x.dtype == torch.float32:  # prompts: MKL or oneDNN, the faster here
            return float32_linear(x, weight, tuning.onednn_float32)
        if tuning.float_dots and takes_float_dots(x, weight):
            return torch.ops.mixtral_infer_dots.float_dots(x, weight)
        if tuning.bfloat16_dots and takes_float_dots(x, weight, torch.bfloat16):
            return torch.ops.mixtral_infer_dots.bfloat16_dots(x, weight)
        if x.device.type != "cpu" or x.dtype != torch.float32 or not tuning.few_row_blocks:
            return F.linear(x, weight)
        return few_row_blocks(x, weight)


def takes_float_dots(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``kernels/float_dots.cpp`` multiplies this product: CPU tensors of ``dtype`` (float32:
    ``float_dots``; bfloat16: ``bfloat16_dots``), ``x (M, IN)`` with M at most ``MAX_ROWS`` and a
    contiguous ``weight (OUT, IN)``, outside compiled code, recording no gradient (the operator has no
    backward), and the library loaded (built on the first call)."""
    if x.device.type != "cpu" or x.dtype != dtype or weight.dtype != dtype:
        return False
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or weight.dim() != 2 or not weight.is_contiguous():
        return False
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return False
    return native.loaded()


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
