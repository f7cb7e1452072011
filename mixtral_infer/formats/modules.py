"""Fast modules swapped in for the reference model's, after loading (``use_formats``).

The model (``mixtral_infer.model``) calls ``self.wq(x)`` and never asks what its weights are.
Here each kind of weight gets a module with its own ``forward``, a subclass of the reference
module it replaces, so parameter names, ``state_dict()`` and ``model.to`` stay as they were:

====================  ==================================  ======================================
weight (``.weight``)   module                              forward
====================  ==================================  ======================================
``nn.Parameter``       ``PlainLinear``                     ``kernels.linear.linear``: few-row CPU
                                                           products over every core, compiled
                                                           reductions, prompts widened
``PackedParameter``    ``PackedLinear``                    oneDNN's packed bfloat16 product
``ColumnBlocks…``      ``ColumnBlocksLinear``              blocks of columns (compiled decoding)
``QuantizedParameter`` ``QuantizedLinear``                 the device's int8 / int4 / nf4 / w8a8
                                                           / GemLite kernel (``quant.kernels``)
====================  ==================================  ======================================

and the blocks that multiply one input by several weights read them in one product where they
are joined side by side (``FastAttention``: ``wq wk wv``; ``FastFeedForward``: ``w1 w3``;
``FastMoeLayer``: an expert's ``w1 w3``, and its kernels read an expert in place; or, with
``Tuning.triton_experts``, all the chosen experts in two Triton launches), with CUDA's attention
kernels (``fast.cuda_attention``).

``Tuning(fast=False)`` keeps the reference modules; weights that are not plain parameters
(quantized ones) then get modules whose forward is the reference: ``dequantize`` and ``F.linear``.
The swap changes an instance's class (``module.__class__``) to a subclass that adds no state but
the ``tuning`` its kernels follow (``module.tuning``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mixtral_infer.fast.batched_attention import batched_attention
from mixtral_infer.fast.cache_gather import gathered_kv
from mixtral_infer.fast.cpu_column_blocks import ColumnBlocks
from mixtral_infer.fast.cpu_packed import PackedWeight, packed_linear
from mixtral_infer.fast.cpu_upcast import should_upcast, upcast_linear
from mixtral_infer.fast.cuda_attention import cuda_attention
from mixtral_infer.kernels.linear import column_blocks_linear, linear, linears
from mixtral_infer.kernels.moe import FastMoeLayer, ReferenceQuantizedMoeLayer, moe_class  # noqa: F401 (where tests and docs find them)
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.model.transformer import Attention, FeedForward
from mixtral_infer.quant.kernels import quantized_linear, reference_linear
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning


class PlainLinear(nn.Linear):
    """A float weight ``(OUT, IN)``, through ``kernels.linear.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.tuning)


class PackedLinear(nn.Linear):
    """A bfloat16 weight in oneDNN's layout (``fast.cpu_packed``); prompts the CPU multiplies
    faster in float32 are widened (``fast.cpu_upcast``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if should_upcast(x, self.tuning.upcast):
            return upcast_linear(x, self.weight.dense(), self.tuning.onednn_float32)
        return packed_linear(x, self.weight)


class ColumnBlocksLinear(nn.Linear):
    """A float weight with long rows kept in blocks of columns (``fast.cpu_column_blocks``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_blocks_linear(x, self.weight, self.tuning)


class QuantizedLinear(nn.Linear):
    """Integers and scales (``quant.weights``) through the device's kernel (``quant.kernels``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.weight, self.tuning)


class ReferenceQuantizedLinear(nn.Linear):
    """Integers and scales, read the readable way: ``F.linear(x, dequantize(weight))``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference_linear(x, self.weight)


class FastAttention(Attention):
    """``wq wk wv`` in one product where they are joined side by side; CUDA's attention kernels."""

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xq, xk, xv = linears(x, self.wq.weight, self.wk.weight, self.wv.weight, tuning=self.tuning)
        return xq, xk, xv

    def kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias) -> torch.Tensor:
        return cuda_attention(q, k, v, bias) if q.is_cuda else batched_attention(q, k, v, bias)

    def cached_keys(self, cache, xk: torch.Tensor, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gathered_kv(cache, xk, xv)


class FastFeedForward(FeedForward):
    """``w1 w3`` in one product where they are joined side by side."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linears(x, self.w1.weight, self.w3.weight, tuning=self.tuning)  # (T, I) each
        return self.parallel.all_reduce(self.w2(F.silu(gate) * up))


def linear_class(weight: object, fast: bool) -> type:
    """The module for a linear layer holding ``weight``."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedLinear if fast else ReferenceQuantizedLinear
    if isinstance(weight, PackedWeight):
        return PackedLinear
    if isinstance(weight, ColumnBlocks):
        return ColumnBlocksLinear
    return PlainLinear if fast else nn.Linear


def block_class(module: nn.Module, fast: bool) -> Optional[type]:
    """The module for an attention, feed-forward or MoE block, or None for any other module."""
    if isinstance(module, MoeLayer):
        return moe_class(module, fast)
    if isinstance(module, Attention):
        return FastAttention if fast else Attention
    if isinstance(module, FeedForward):
        return FastFeedForward if fast else FeedForward
    return None


def use_formats(model: nn.Module, tuning: Optional[Tuning] = None) -> nn.Module:
    """Give every module of ``model`` the class its weights and ``tuning`` call for, in place
    (the reference classes for ``Tuning(fast=False)``). Run again after weights are replaced."""
    tuning = tuning if tuning is not None else tuning_of(model)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            wanted = linear_class(module.weight, tuning.fast)
        else:
            wanted = block_class(module, tuning.fast)
        if wanted is not None and type(module) is not wanted:
            module.__class__ = wanted
        if wanted is not None:
            module.__dict__["tuning"] = tuning
        if isinstance(module, FastMoeLayer):
            module.swapped_in(tuning)  # its strategy, for these weights and this tuning
    return model


def tuning_of(model: nn.Module) -> Tuning:
    """The tuning ``use_formats`` gave ``model``, or ``Tuning.default()`` for a model it has not seen."""
    for module in model.modules():
        tuning = module.__dict__.get("tuning")
        if tuning is not None:
            return tuning
    return Tuning.default()


def replace_parameter(model: nn.Module, name: str, new: nn.Module | nn.Parameter) -> None:
    """Put ``new`` (a weight holder, or a parameter again) where attribute ``name`` of ``model`` was,
    and give the module holding it the class that reads it (``use_formats``)."""
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if hasattr(module, leaf):
        delattr(module, leaf)
    setattr(module, leaf, new)
    use_formats(model)
