"""bfloat16 weights in oneDNN's packed layout, on CPU: the eager CPU default for bfloat16.

oneDNN reads a matrix it has reordered into its own blocked layout faster than a plain one
(``fast.cpu_packed``, which holds the layout and the op). At load (``load_model``'s ``pack=True``)
the float matrices that decoding reads are packed, ``wq wk wv`` side by side, as are ``w1 w3``
(``fast.cpu_packed.SIDE_BY_SIDE``): one product reads a group (gpt-fast's fused ``wqkv``), split
after. Prompts the CPU multiplies faster in float32 are widened (``fast.cpu_upcast``).
"""

from __future__ import annotations

from typing import Collection, List, Sequence

import torch
from torch import nn

from mixtral_infer.fast.cpu_packed import PACKED_DTYPES, PackedParameter, PackedWeight, can_pack, pack, pack_side_by_side
from mixtral_infer.fast.cpu_packed import packed_linear, side_by_side, side_by_side_groups
from mixtral_infer.fast.cpu_upcast import should_upcast, upcast_linear
from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend, put_weight
from mixtral_infer.quant.model import is_quantized
from mixtral_infer.tuning import Tuning


class PackedBf16Linear(LinearBackend):
    """A weight in oneDNN's layout (``fast.cpu_packed.PackedWeight``) (module docstring)."""

    devices = ("cpu",)

    @classmethod
    def reads(cls, weight: object) -> bool:
        return isinstance(weight, PackedWeight)

    @classmethod
    def prepare_model(cls, model: nn.Module, tuning: Tuning, pack: bool | str) -> None:
        if pack is True:
            pack_matrices(model)

    @staticmethod
    def product(x: torch.Tensor, weight: PackedWeight, tuning: Tuning = DEFAULT) -> torch.Tensor:
        if should_upcast(x, tuning.upcast):
            return upcast_linear(x, weight.dense(), tuning.onednn_float32)
        return packed_linear(x, weight)

    @classmethod
    def products(cls, x: torch.Tensor, weights: Sequence, tuning: Tuning = DEFAULT) -> List[torch.Tensor]:
        """Weights packed side by side at load: one product of the group, split."""
        whole = side_by_side(weights)
        if whole is None:
            return [cls.product(x, weight, tuning) for weight in weights]
        return list(cls.product(x, whole, tuning).split([weight.shape[-2] for weight in weights], dim=-1))


def pack_matrices(model: nn.Module, dtypes: Collection[torch.dtype] = PACKED_DTYPES) -> None:
    """Pack, in place, the float matrices that decoding reads (those ``quant.model`` would quantize):
    ``wq wk wv`` side by side, as are ``w1 w3`` (``SIDE_BY_SIDE``), the others one by one.
    ``dtypes``: the float types packed, where this CPU's oneDNN reorders them (``onednn_packs``):
    bfloat16 by default (``fast.cpu_packed``); float32 packs on every x86 CPU, and is how the tests
    exercise the packed paths on a CPU without AVX-512."""
    params = dict(model.named_parameters())
    packable = [name for name, param in params.items() if is_quantized(name) and can_pack(param, dtypes)]
    for group in side_by_side_groups(packable, lambda name: params[name].shape):
        tensors = [params[n].data for n in group]
        weights = pack_side_by_side(tensors) if len(group) > 1 else [pack(tensors[0])]
        for n, weight in zip(group, weights):
            put_weight(model, n, PackedParameter(weight))
