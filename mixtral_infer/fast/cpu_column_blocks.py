"""Weights with long rows kept in blocks of columns, for compiled decoding on CPU.

A compiled few-row product multiplies each row of the weight by the input row ``x`` and sums
(``fast.cpu_reductions``). Each core walks its share of the weight's rows, converting ``x``
to float32 once and rereading it for every row: while those ``IN`` floats stay in the core's L1
cache beside the streaming weight, the loop reads the weight at the memory's speed. Rows of 2048
(8 KB of ``x``) fit a 32 KB L1 beside the weight; rows of 4096 and more do not reliably, and are
then read markedly slower.

So float weights (16-bit or float32) and int8 integers whose rows are longer than ``MAX_BLOCK``
are stored as ``n`` blocks of equal width ``B <= MAX_BLOCK``, each block its own contiguous
``(OUT, B)`` matrix: ``(OUT, IN) -> (n, OUT, B)``. The product is then ``n`` products with rows
of ``B``, one after the other, each against its own piece of ``x``, added up. At Mistral 7B's
and Mixtral 8x7B's widths every matrix decoding reads is blocked (rows of 4096 in 2 blocks, w2's
14336 in 7). Reading the plain weight's columns in blocks through a strided view instead, without
moving them, gains nothing: the rows' pieces are then far apart from each other.

Example, ``IN = 4``, two blocks of ``B = 2``::

    weight [[1, 2, 3, 4],      blocks [[[1, 2],      [[3, 4],
            [5, 6, 7, 8]]  ->           [5, 6]],      [7, 8]]]

    x = [1, 1, 1, 1]:  block sums [3, 11] + [7, 15] = [10, 26] = weight @ x

``ColumnBlocks`` holds the blocks; ``linear()`` recognises it, so the model's code is the same
whatever the layout. Compiled products of a few rows read the blocks (``cpu_reductions``, up to
``REDUCTION_ROWS``); compiled products of more rows (larger batches, the serving step's prompt
chunks) multiply block by block (``block_products``, no copy of the weight in the graph; each
block's product is rounded to the 16-bit type before the sum). Eager 16-bit products (prompts, the
eager loop) multiply the plain weight, put back together for the call (``dense()``: a copy, so the
readable path's numbers are the plain weight's; int8 integers likewise, ``integers()``). Eager
float32 products multiply block by block too: float32 sums round nothing between blocks, and the
copy would cost more than the product.

``load_model(..., pack="columns")`` stores a model's long rows so (the CLI's ``--decode compiled``
loads that way); ``state_dict()`` still gives the plain weights, and ``unblock_long_rows`` puts
plain parameters back for code that edits weights.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from mixtral_infer.fast.cpu_reductions import expert_of

MAX_BLOCK = 2048  # longest row whose float32 input stays in L1 beside the streaming weight (module docstring)
BLOCKED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what compiled code multiplies as reductions


def block_width(in_features: int) -> Optional[int]:
    """The width of the fewest equal blocks of at most ``MAX_BLOCK`` columns that rows of
    ``in_features`` split into, or None when they need no splitting (or do not split evenly).
    ``block_width(14336) == 2048`` (7 blocks), ``block_width(4096) == 2048``, ``block_width(2048) is None``."""
    if in_features <= MAX_BLOCK:
        return None
    for n_blocks in range(-(-in_features // MAX_BLOCK), in_features // 32 + 1):
        if in_features % n_blocks == 0:
            return in_features // n_blocks
    return None


class ColumnBlocks:
    """A weight ``(..., OUT, IN)`` held as ``blocks (..., n, OUT, B)``, ``IN = n * B`` (module docstring).
    Leading dimensions are stacked experts: ``weight[e]`` is expert ``e``'s blocks."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    @property
    def shape(self) -> torch.Size:
        *stacked, n_blocks, out_features, width = self.blocks.shape
        return torch.Size((*stacked, out_features, n_blocks * width))

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def numel(self) -> int:
        return self.blocks.numel()

    def __getitem__(self, index) -> "ColumnBlocks":
        """Expert ``index`` (an int or a tensor, as a tensor is indexed) of stacked weights."""
        if self.blocks.dim() < 4:
            raise IndexError(f"a {tuple(self.shape)} weight is one matrix; only stacked experts are indexed")
        return ColumnBlocks(expert_of(self.blocks, index))

    def dense(self) -> torch.Tensor:
        """The plain weight ``(..., OUT, IN)``, a copy."""
        return self.blocks.transpose(-3, -2).flatten(-2)


def block_products(x: torch.Tensor, weight: ColumnBlocks) -> torch.Tensor:
    """``x (M, IN) @ weight (OUT, IN).T`` -> ``(M, OUT)`` block by block: one batched product of each
    block with its piece of ``x`` (each rounded to ``x``'s dtype), summed. What compiled code does
    with more rows than the reductions take (putting the plain weight back together there would
    copy it on every step), and every float32 product op by op (nothing is rounded between blocks)."""
    blocks = weight.blocks  # (n, OUT, B)
    parts = x.reshape(x.shape[0], blocks.shape[0], -1).transpose(0, 1)  # (n, M, B)
    return torch.bmm(parts, blocks.transpose(1, 2)).sum(0)  # (n, M, OUT) -> (M, OUT)


def to_blocks(weight: torch.Tensor, width: int) -> ColumnBlocks:
    """``weight (..., OUT, IN)`` as blocks of ``width`` columns: ``(..., IN / width, OUT, width)``."""
    return ColumnBlocks(weight.unflatten(-1, (-1, width)).transpose(-3, -2).contiguous())


class ColumnBlocksParameter(nn.Module, ColumnBlocks):
    """A ``ColumnBlocks`` held by a model in place of an ``nn.Parameter``: the blocks are a buffer
    (``model.to(...)`` moves them); ``state_dict()`` gives the plain weight under the parameter's name."""

    def __init__(self, weight: ColumnBlocks):
        nn.Module.__init__(self)
        self.register_buffer("blocks", weight.blocks, persistent=False)
        self._register_state_dict_hook(_plain_in_state_dict)

    def extra_repr(self) -> str:
        n_blocks, width = self.blocks.shape[-3], self.blocks.shape[-1]
        return f"shape={tuple(self.shape)}, dtype={self.dtype}, {n_blocks} blocks of {width} columns"


def _plain_in_state_dict(module: ColumnBlocksParameter, state_dict: dict, prefix: str, local_metadata) -> None:
    state_dict[prefix[:-1]] = module.dense()  # prefix is "layers.0.feed_forward.w2.weight."


def blocks_rows(tensor: torch.Tensor) -> bool:
    """Whether ``block_long_rows`` stores this weight in blocks: a float CPU matrix (or stacked
    experts) with rows longer than ``MAX_BLOCK`` that split evenly."""
    return (
        tensor.device.type == "cpu"
        and tensor.dtype in BLOCKED_DTYPES
        and tensor.dim() in (2, 3)
        and block_width(tensor.shape[-1]) is not None
    )


def blocks_integers(weight) -> bool:
    """Whether ``block_long_rows`` blocks this quantized weight: int8 weight-only integers on CPU
    with rows longer than ``MAX_BLOCK`` (w8a8's are fbgemm's; int4's, their kernel's)."""
    return (
        weight.scheme.name == "int8" and weight.values is not None and weight.prepacked is None
        and weight.device.type == "cpu" and block_width(weight.in_features) is not None
    )  # fmt: skip


def int8_blocks(weight) -> Optional[torch.Tensor]:
    """The column blocks ``(..., n, OUT, B)`` of a quantized weight's int8 integers, if it holds them so."""
    if weight.scheme.name != "int8" or weight.values is not None or weight.packed is None:
        return None
    return weight.packed[0]
