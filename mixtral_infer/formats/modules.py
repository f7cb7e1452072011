"""The fast modules swapped in for the reference model's after loading, and the one call that
prepares a loaded model's weights and swaps them in (``prepare_and_swap``).

The model (``mixtral_infer.model``) calls ``self.wq(x)`` and never asks what its weights are.
Each linear layer becomes the weight back-end that reads its weight (``kernels.linear``: one file
per back-end, one table, ``backend_for``), a subclass of ``nn.Linear``, so parameter names,
``state_dict()`` and ``model.to`` stay as they were. The blocks that multiply one input by several
weights read them in one product where their back-end joined them side by side at load
(``FastAttention``: ``wq wk wv``; ``FastFeedForward``: ``w1 w3``), with CUDA's attention kernels
(``fast.cuda_attention``); the MoE layers take their strategy (``kernels.moe``).

``Tuning(fast=False)`` keeps the reference modules; weights that are not plain parameters
(quantized ones) then get the reference back-end: ``dequantize`` and ``F.linear``. A swap changes an
instance's class (``module.__class__``) to a subclass that adds no state but the ``tuning`` it is
given (``LinearBackend.swapped_in``, ``FastMoeLayer.swapped_in``); the model keeps it too
(``tuning_of``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from mixtral_infer.fast.batched_attention import batched_attention
from mixtral_infer.formats.adapters import unadapted, with_update
from mixtral_infer.fast.cache_gather import gathered_kv
from mixtral_infer.fast.cuda_attention import cuda_attention
from mixtral_infer.kernels.linear import LinearBackend, backend_for, prepare_model, put_weight
from mixtral_infer.kernels.moe import FastMoeLayer, ReferenceQuantizedMoeLayer, moe_class  # noqa: F401 (where tests and docs find them)
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.model.transformer import Attention, FeedForward
from mixtral_infer.tuning import Tuning


class FastAttention(Attention):
    """``wq wk wv`` in one product where they are joined side by side; CUDA's attention kernels."""

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        projections = (self.wq, self.wk, self.wv)
        wq, wk, wv = (unadapted(p) for p in projections)  # adapters kept apart: the base product, then theirs
        if not type(wq) is type(wk) is type(wv):  # one replaced since: each by its own back-end
            return self.wq(x), self.wk(x), self.wv(x)
        products = type(wq).products(x, (wq.weight, wk.weight, wv.weight), self.tuning)
        xq, xk, xv = (with_update(p, x, out) for p, out in zip(projections, products))
        return xq, xk, xv

    def kernel(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias) -> torch.Tensor:
        return cuda_attention(q, k, v, bias) if q.is_cuda else batched_attention(q, k, v, bias)

    def cached_keys(self, cache, xk: torch.Tensor, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gathered_kv(cache, xk, xv)


class FastFeedForward(FeedForward):
    """``w1 w3`` in one product where they are joined side by side."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w3 = unadapted(self.w1), unadapted(self.w3)  # adapters kept apart: the base product, then theirs
        if type(w1) is type(w3):
            gate, up = type(w1).products(x, (w1.weight, w3.weight), self.tuning)  # (T, I) each
            gate, up = with_update(self.w1, x, gate), with_update(self.w3, x, up)
        else:  # one replaced since: each by its own back-end
            gate, up = self.w1(x), self.w3(x)
        return self.parallel.all_reduce(self.w2(F.silu(gate) * up))


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
            backend_for(module.weight, tuning).swapped_in(module, tuning)
            continue
        wanted = block_class(module, tuning.fast)
        if wanted is None:
            continue
        module.__class__ = wanted
        if isinstance(module, FastMoeLayer):
            module.swapped_in(tuning)  # its strategy, for these weights and this tuning
        else:
            module.tuning = tuning
    model.tuning = tuning
    return model


def prepare_and_swap(model: nn.Module, tuning: Tuning, pack: bool | str = True) -> nn.Module:
    """What loading does once the model is built: the layouts the back-ends want for weights that go
    together (``kernels.linear.prepare_model``: nf4 and w8a8 groups joined, bfloat16 packed for oneDNN
    with ``pack=True`` or long rows in blocks of columns with ``pack="columns"``), then ``use_formats``."""
    return use_formats(prepare_model(model, tuning, pack), tuning)


def tuning_of(model: nn.Module) -> Tuning:
    """The tuning ``use_formats`` gave ``model``, or ``Tuning.default()`` for a model it has not seen."""
    tuning = getattr(model, "tuning", None)
    if isinstance(tuning, Tuning):
        return tuning
    swapped = (LinearBackend, FastMoeLayer, FastAttention, FastFeedForward)  # a part swapped on its own
    return next((module.tuning for module in model.modules() if isinstance(module, swapped)), Tuning.default())


def replace_parameter(model: nn.Module, name: str, new: nn.Module | nn.Parameter) -> None:
    """Put ``new`` (a weight holder, or a parameter again) where attribute ``name`` of ``model`` was,
    and give the module holding it the class that reads it (``use_formats``)."""
    put_weight(model, name, new)
    use_formats(model)
