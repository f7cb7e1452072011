"""int8 weight-only integers (one scale per output row): PyTorch's int8 kernels.

* **CPU**: ``torch.ops.aten._weight_int8pack_mm`` (reads the int8 weight at the speed ``F.linear``
  reads bfloat16, so in half the time). torchao's ``Int8WeightOnlyConfig`` runs a
  dequantize-then-matmul on CPU, far slower. For bfloat16 activations only
  (``quantized_common.uses_cpu_kernel``); others take the reference.
* **CPU, many rows** (prefill chunks of at least ``DEQUANTIZE_ROWS``): the kernel is compute-bound
  there, and dequantizing (``dequantize_int8``) then multiplying with ``F.linear`` is faster
  (widened to float32 where ``Tuning.upcast`` says this CPU multiplies float32 faster).
* **CPU, compiled code, 1-8 rows** (decoding): multiply-and-sum reductions that inductor writes
  (``fast.cpu_reductions``), faster than the kernel. Integers with long rows, loaded with
  ``pack="columns"``, are kept only as column blocks (``column_blocks``; ``packed = (blocks,
  scales)``), which the reductions read; compiled code with more rows runs the kernel block by
  block (``int8_blocks_linear``), and op by op the kernel gets them put back together
  (``integers()``).
* **One expert of stacked weights** (``weight.expert``, compiled code's routing): the op
  ``mixtral_infer::int8_expert_mm`` reads that expert's views, where a gather would copy it first.
* **CUDA**: as gpt-fast does it, ``F.linear(x, q.to(x.dtype)) * scales`` (compiled, the
  conversion fuses into the product).

w8a8 weights where fbgemm did not pack them (a PyTorch without it, or on CUDA) are int8 weights here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_column_blocks import int8_blocks
from mixtral_infer.fast.cpu_reductions import reduces, rows_as_reductions
from mixtral_infer.fast.cpu_upcast import should_upcast, upcast_linear
from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend
from mixtral_infer.kernels.linear.quantized_common import DEQUANTIZE_ROWS, uses_cpu_kernel
from mixtral_infer.kernels.linear.reference import reference_linear
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning

# One expert of stacked weights, the expert a 0-d tensor: the op reads it and calls the CPU kernel on
# that expert's views. Declared with torch.library.Library, as fast.cpu_packed's op: the dispatcher
# calls the function directly.
_LIBRARY = torch.library.Library("mixtral_infer", "FRAGMENT")
_LIBRARY.define("int8_expert_mm(Tensor x, Tensor values, Tensor scales, Tensor expert) -> Tensor")


def _int8_expert_mm(x, values, scales, expert):
    e = int(expert)
    return torch.ops.aten._weight_int8pack_mm(x, values[e], scales[e])


_LIBRARY.impl("int8_expert_mm", _int8_expert_mm, "CPU")


@torch.library.register_fake("mixtral_infer::int8_expert_mm")
def _(x, values, scales, expert):
    return x.new_empty(x.shape[0], values.shape[1])


class Int8Linear(LinearBackend):
    """int8 integers and scales (``quant.weights.QuantizedWeight``) (module docstring)."""

    @classmethod
    def reads(cls, weight: object) -> bool:
        return isinstance(weight, QuantizedWeight) and weight.scheme.name == "int8"

    @staticmethod
    def product(x: torch.Tensor, weight: QuantizedWeight, tuning: Tuning = DEFAULT) -> torch.Tensor:
        if weight.values is not None and reduces(x, weight.values):  # compiled CPU decoding
            weight = weight.resolved()  # one expert of stacked weights: compiled code reads it in place
            return rows_as_reductions(x, weight.values, weight.scales, tuning.streams)
        if int8_blocks(weight) is not None and torch.compiler.is_compiling():
            return int8_blocks_linear(x, weight, tuning.streams)
        if weight.expert is not None:
            if uses_cpu_kernel(x, weight) and x.shape[0] < DEQUANTIZE_ROWS and weight.values is not None:
                return torch.ops.mixtral_infer.int8_expert_mm(x.contiguous(), weight.values, weight.scales, weight.expert)
            weight = weight.resolved()
        if uses_cpu_kernel(x, weight):
            x = x.contiguous()
            if x.shape[0] < DEQUANTIZE_ROWS:
                return torch.ops.aten._weight_int8pack_mm(x, weight.integers(), weight.scales)
            if should_upcast(x, tuning.upcast):  # this CPU multiplies float32 faster (fast.cpu_upcast)
                return upcast_linear(x, dequantize_int8(weight, torch.float32), tuning.onednn_float32)
            return F.linear(x, dequantize_int8(weight, x.dtype))  # reference_linear, bit for bit
        if x.device.type == "cuda" and weight.values is not None:
            return F.linear(x, weight.values.to(x.dtype)) * weight.scales.to(x.dtype)
        return reference_linear(x, weight)


def int8_blocks_linear(x: torch.Tensor, weight: QuantizedWeight, streams: int = DEFAULT.streams) -> torch.Tensor:
    """Compiled code's ``x (M, IN) @ weight.T`` for int8 integers held in column blocks
    (``fast.cpu_column_blocks``), without putting them back together (a copy on every step): a few
    rows as reductions over the blocks (read in ``streams`` places), more rows block by block through
    the int8 kernel, each block's product rounded to ``x``'s dtype before the sum."""
    weight = weight.resolved()  # one expert of stacked weights (compiled code gives an expert one row: read in place)
    blocks = int8_blocks(weight)  # (n, OUT, B)
    if reduces(x, blocks):
        return rows_as_reductions(x, blocks, weight.scales, streams)
    if not uses_cpu_kernel(x, weight):
        return reference_linear(x, weight)
    parts = x.reshape(x.shape[0], blocks.shape[0], -1).unbind(1)  # n x (M, B)
    int8pack_mm = torch.ops.aten._weight_int8pack_mm
    products = [int8pack_mm(part.contiguous(), block, weight.scales) for part, block in zip(parts, blocks.unbind(0))]
    return torch.stack(products).sum(0)  # (n, M, OUT) -> (M, OUT)


def dequantize_int8(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """``weight.dequantize(dtype)`` of an int8 weight, bit for bit, in one conversion and one
    multiply in place: for prompts, where the reference's two float32 copies of the weight cost
    a good part of the product. The same numbers: an integer of at most 127 is exact in any float dtype, and
    PyTorch multiplies 16-bit numbers in float32, where ``q * scale`` is exact, rounding once."""
    return weight.integers().to(dtype).mul_(weight.scales[..., None])  # (..., OUT, IN)
