"""Keeping a loaded model's float weights in the layouts the CPU kernels read fastest, in place.

``pack_model``: bfloat16 matrices in oneDNN's layout (``fast.cpu_packed``), ``wq wk wv`` and
``w1 w3`` side by side; ``block_long_rows``: rows longer than the kernels keep in cache stored in
blocks of columns (``fast.cpu_column_blocks``), for compiled decoding. Each weight holder takes
its parameter's place, and the module holding it becomes the one that reads it
(``formats.modules.replace_parameter``); ``unpack_model`` and ``unblock_long_rows`` put plain
parameters back, for code that edits weights. ``state_dict()`` gives the plain weights either way.
"""

from __future__ import annotations

from typing import Collection

import torch
from torch import nn

from mixtral_infer.fast.cpu_column_blocks import ColumnBlocksParameter, block_width, blocks_integers, blocks_rows, int8_blocks, to_blocks
from mixtral_infer.fast.cpu_packed import PACKED_DTYPES, PackedParameter, can_pack, pack, pack_side_by_side, side_by_side_groups
from mixtral_infer.formats.modules import replace_parameter
from mixtral_infer.quant.model import is_quantized
from mixtral_infer.quant.weights import QuantizedParameter


def pack_model(model: nn.Module, dtypes: Collection[torch.dtype] = PACKED_DTYPES) -> nn.Module:
    """Pack, in place, the float matrices that decoding reads (those ``quant.model`` would quantize):
    ``wq wk wv`` side by side, as are ``w1 w3`` (``SIDE_BY_SIDE``), the others one by one.
    ``dtypes``: the float types packed, where this CPU's oneDNN reorders them (``onednn_packs``):
    bfloat16 by default (``fast.cpu_packed``); float32 packs on every x86 CPU, and is how the tests
    exercise the packed paths on a CPU without AVX-512."""# here: formats import this module
    params = dict(model.named_parameters())
    packable = [name for name, param in params.items() if is_quantized(name) and can_pack(param, dtypes)]
    for group in side_by_side_groups(packable, lambda name: params[name].shape):
        tensors = [params[n].data for n in group]
        weights = pack_side_by_side(tensors) if len(group) > 1 else [pack(tensors[0])]
        for n, weight in zip(group, weights):
            replace_parameter(model, n, PackedParameter(weight))
    return model


def unpack_model(model: nn.Module) -> nn.Module:
    """Plain ``nn.Parameter``s again, in place: for code that edits weights or compiles the model."""# here: formats import this module
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
    """Store, in place, the long-row matrices that decoding reads (those ``quant.model`` would
    quantize: ``w2`` at Mistral 7B's widths) in column blocks: float parameters, and int8
    weight-only integers on CPU, which then keep the blocks as their kernel layout
    (``packed = (blocks, scales)``, ``values`` dropped: ``integers()`` puts them back together)."""# here: formats import this module
    for name, param in list(model.named_parameters()):
        if is_quantized(name) and blocks_rows(param):
            blocks = to_blocks(param.data, block_width(param.shape[-1]))
            replace_parameter(model, name, ColumnBlocksParameter(blocks))
    for module in model.modules():
        if isinstance(module, QuantizedParameter) and blocks_integers(module):
            module.kernel_values = to_blocks(module.values, block_width(module.in_features)).blocks
            module.kernel_scales, module.values = module.scales, None
    return model


def unblock_long_rows(model: nn.Module) -> nn.Module:
    """Plain ``nn.Parameter``s (and int8 integers) again, in place: for code that edits weights."""# here: formats import this module
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
