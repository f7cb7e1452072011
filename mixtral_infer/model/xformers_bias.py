"""The xformers attention-bias classes, imported without noise on CPU-only machines.

Importing anything from xformers loads its C++/CUDA extension and, when that
fails (always on a CPU-only machine), logs "xFormers can't load C++/CUDA
extensions". The bias classes are pure Python and work anyway, so on a machine
without CUDA the warning says nothing useful: it is silenced for the import.
On a CUDA machine it is left alone, since there it means the kernels are missing.
"""

import logging
from typing import Optional

import torch


def _import_quietly():
    logger = logging.getLogger("xformers")
    level = logger.level
    if not torch.cuda.is_available():
        logger.setLevel(logging.CRITICAL)
    try:
        from xformers.ops.fmha import attn_bias
    finally:
        logger.setLevel(level)
    return attn_bias


attn_bias = _import_quietly()

AttentionBias = attn_bias.AttentionBias
BlockDiagonalMask = attn_bias.BlockDiagonalMask
BlockDiagonalCausalMask = attn_bias.BlockDiagonalCausalMask
BlockDiagonalCausalFromBottomRightMask = attn_bias.BlockDiagonalCausalFromBottomRightMask
BlockDiagonalCausalLocalAttentionMask = attn_bias.BlockDiagonalCausalLocalAttentionMask
BlockDiagonalCausalLocalAttentionFromBottomRightMask = attn_bias.BlockDiagonalCausalLocalAttentionFromBottomRightMask
BlockDiagonalCausalWithOffsetPaddedKeysMask = attn_bias.BlockDiagonalCausalWithOffsetPaddedKeysMask


def block_semantics(bias: BlockDiagonalMask) -> tuple[bool, Optional[int]]:
    """(from_bottom_right, window) of a causal block-diagonal bias: what every attention
    path (SDPA per block, torch's varlen flash attention) needs to know of it. The cache
    only makes causal biases, so a non-causal one is refused."""
    if isinstance(bias, BlockDiagonalCausalLocalAttentionFromBottomRightMask):
        return True, bias._window_size
    if isinstance(bias, BlockDiagonalCausalFromBottomRightMask):
        return True, None
    if isinstance(bias, BlockDiagonalCausalLocalAttentionMask):
        return False, bias._window_size
    if isinstance(bias, BlockDiagonalCausalMask):
        return False, None
    raise NotImplementedError(f"no attention for bias type {type(bias).__name__} (only causal ones are made)")
