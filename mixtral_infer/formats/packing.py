"""A model in memory, its float weights put in (or out of) the layouts the CPU back-ends read, in place.

``pack_model``: bfloat16 matrices in oneDNN's layout (``kernels.linear.packed_bf16``), ``wq wk wv``
and ``w1 w3`` side by side; ``block_long_rows``: rows longer than the kernels keep in cache stored in
blocks of columns (``kernels.linear.column_blocks``), for compiled decoding. Loading does both through
``formats.modules.prepare_and_swap``; these are for a model already in memory. Each weight holder takes
its parameter's place, and the module holding it becomes the back-end that reads it
(``use_formats``); ``unpack_model`` and ``unblock_long_rows`` put plain parameters back, for code
that edits weights. ``state_dict()`` gives the plain weights either way.
"""

from __future__ import annotations

from typing import Collection

import torch
from torch import nn

from mixtral_infer.fast.cpu_column_blocks import ColumnBlocksParameter, int8_blocks
from mixtral_infer.fast.cpu_packed import PACKED_DTYPES, PackedParameter
from mixtral_infer.formats.modules import replace_parameter, use_formats
from mixtral_infer.kernels.linear import column_blocks, packed_bf16
from mixtral_infer.quant.weights import QuantizedParameter


def pack_model(model: nn.Module, dtypes: Collection[torch.dtype] = PACKED_DTYPES) -> nn.Module:
    """``kernels.linear.packed_bf16.pack_matrices`` (``dtypes``: float32 too, where a test exercises the
    packed paths on a CPU without AVX-512), then the modules that read them swapped in."""
    packed_bf16.pack_matrices(model, dtypes)
    return use_formats(model)


def unpack_model(model: nn.Module) -> nn.Module:
    """Plain ``nn.Parameter``s again, in place: for code that edits weights or compiles the model."""
    for name, module in list(model.named_modules()):
        if isinstance(module, PackedParameter):
            replace_parameter(model, name, nn.Parameter(module.dense(), requires_grad=False))
    return model


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(module, PackedParameter) for module in model.modules())


def packed_numel(model: nn.Module) -> int:
    """How many weights a model holds packed (``model.parameters()`` counts only the plain ones)."""
    return sum(module.shape.numel() for module in model.modules() if isinstance(module, PackedParameter))


def block_long_rows(model: nn.Module) -> nn.Module:
    """``kernels.linear.column_blocks.block_long_rows`` (float matrices with long rows, and int8
    integers on CPU, in blocks of columns), then the modules that read them swapped in."""
    column_blocks.block_long_rows(model)
    return use_formats(model)


def unblock_long_rows(model: nn.Module) -> nn.Module:
    """Plain ``nn.Parameter``s (and int8 integers) again, in place: for code that edits weights."""
    for name, module in list(model.named_modules()):
        if isinstance(module, ColumnBlocksParameter):
            replace_parameter(model, name, nn.Parameter(module.dense(), requires_grad=False))
        elif isinstance(module, QuantizedParameter) and int8_blocks(module) is not None:
            module.values = module.integers()
            module.kernel_values = module.kernel_scales = None
    return model


def blocked_numel(model: nn.Module) -> int:
    """How many float weights a model holds in column blocks (``model.parameters()`` counts only the
    plain ones; quantized weights count as such, blocked or not)."""
    return sum(module.numel() for module in model.modules() if isinstance(module, ColumnBlocksParameter))
