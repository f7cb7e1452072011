"""Float weights with long rows kept in blocks of columns, on CPU: compiled decoding.

Compiled code multiplies a few rows by a plain weight as reductions inductor writes
(``fast.cpu_reductions``); rows longer than the cache keeps beside the streaming weight (Mistral
7B's every matrix) are read faster in blocks of columns (``fast.cpu_column_blocks``, which holds the
layout). At load (``load_model``'s ``pack="columns"``, what the CLI's ``--decode compiled`` asks)
those matrices are stored in blocks, and so are int8 weight-only integers (``int8`` reads them).
Compiled few-row products reduce over the blocks; other compiled products, and float32 ones,
multiply block by block (float32 sums: nothing rounded between blocks); eager 16-bit products the
plain weight put back together.
"""

from __future__ import annotations

import torch
from torch import nn

from mixtral_infer.fast.cpu_column_blocks import ColumnBlocks, ColumnBlocksParameter, block_products, block_width
from mixtral_infer.fast.cpu_column_blocks import blocks_integers, blocks_rows, to_blocks
from mixtral_infer.fast.cpu_reductions import reduces, rows_as_reductions
from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend, put_weight
from mixtral_infer.kernels.linear.int_dots import IntDotsLinear
from mixtral_infer.kernels.linear.plain import PlainLinear
from mixtral_infer.quant.model import is_quantized
from mixtral_infer.quant.weights import QuantizedParameter
from mixtral_infer.tuning import Tuning


class ColumnBlocksLinear(LinearBackend):
    """A weight in blocks of columns (``fast.cpu_column_blocks.ColumnBlocks``) (module docstring)."""

    # Laid out on CPU only; a model moved elsewhere keeps the blocks, multiplied by the plain weight.
    devices = None

    @classmethod
    def reads(cls, weight: object) -> bool:
        return isinstance(weight, ColumnBlocks)

    @classmethod
    def prepare_model(cls, model: nn.Module, tuning: Tuning, pack: bool | str) -> None:
        if pack == "columns":  # int8 integers the integer dot products read stay plain
            block_long_rows(model, integers=not IntDotsLinear.wanted(tuning))

    @staticmethod
    def product(x: torch.Tensor, weight: ColumnBlocks, tuning: Tuning = DEFAULT) -> torch.Tensor:
        if reduces(x, weight):
            return rows_as_reductions(x, weight.blocks, streams=tuning.streams)
        if torch.compiler.is_compiling() or x.dtype == torch.float32:
            return block_products(x, weight)
        return PlainLinear.product(x, weight.dense(), tuning)


def block_long_rows(model: nn.Module, integers: bool = True) -> None:
    """Store, in place, the long-row matrices that decoding reads (those ``quant.model`` would
    quantize: ``w2`` at Mistral 7B's widths) in column blocks: float parameters, and int8
    weight-only integers on CPU, which then keep the blocks as their kernel layout
    (``packed = (blocks, scales)``, ``values`` dropped: ``integers()`` puts them back together);
    ``integers=False`` leaves the integers as they are (``int_dots`` reads them plain)."""
    for name, param in list(model.named_parameters()):
        if is_quantized(name) and blocks_rows(param):
            blocks = to_blocks(param.data, block_width(param.shape[-1]))
            put_weight(model, name, ColumnBlocksParameter(blocks))
    for module in model.modules():
        if integers and isinstance(module, QuantizedParameter) and blocks_integers(module):
            module.kernel_values = to_blocks(module.values, block_width(module.in_features)).blocks
            module.kernel_scales, module.values = module.scales, None
