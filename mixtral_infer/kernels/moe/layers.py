"""The MoE modules swapped in for the reference ``MoeLayer`` (``formats.modules.use_formats``):
``FastMoeLayer`` runs each expert through its weights' kernels and keeps the ``MoeStrategy`` chosen
for its weights and tuning when it was swapped in; ``ReferenceQuantizedMoeLayer`` reads quantized
experts the readable way (``Tuning(fast=False)``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixtral_infer.fast.cpu_reductions import expert_of
from mixtral_infer.kernels.linear import backend_for, laid_out_again, laid_out_for
from mixtral_infer.kernels.moe.float_experts import float_experts, takes_rows
from mixtral_infer.kernels.moe.one_by_one import expert
from mixtral_infer.kernels.moe.strategy import MoeStrategy
from mixtral_infer.kernels.moe.triton_mixture import triton_experts_kind, triton_mixture
from mixtral_infer.model.moe import MoeLayer
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning


class FastMoeLayer(MoeLayer):
    """Each expert through its weights' kernels, read where they lie (``expert``); or with
    ``Tuning.triton_experts`` every token's chosen experts in two Triton launches (``triton_mixture``);
    or with ``Tuning.float_dots``, up to 8 rows of plain float32 experts on CPU, the package's operator
    (``float_experts``).
    ``swapped_in`` gives it its tuning and strategy; ``decode_rows`` runs rows of one token each."""

    tuning: Tuning
    strategy: MoeStrategy

    def swapped_in(self, tuning: Tuning) -> None:
        """Follow ``tuning``: choose the strategy for the weights as they are now (again after a
        weight is replaced, which swaps the layer in again, or cast, ``_apply``). Stacked int4 experts
        still in the plain layout where the integer dot products read them (quantized under another
        tuning) are laid out for those once here, not at every product."""
        self.tuning = tuning
        # The back-end that reads one expert's matrix of each stacked weight (``kernels.linear``'s table)
        self.expert_backends = {name: backend_for(expert_of(getattr(self, name), 0), tuning) for name in ("w1", "w2", "w3")}
        for name, backend in self.expert_backends.items():
            stacked = getattr(self, name)
            laid_out = laid_out_for(stacked, backend, tuning) if backend.inline_int4 else stacked
            if laid_out is not stacked:  # the integer dot products read the laid-out rows too
                setattr(self, name, laid_out)
        self.strategy = MoeStrategy.choose(self, tuning)

    def __setstate__(self, state) -> None:
        """A layer unpickled (``torch.save`` of a model, read in another process): its strategy chosen
        again there, which loads the operators it calls (``float_experts.ready``), its stacked quantized
        experts laid out for the back-end that reads them there (``laid_out_again``: int4 saved for the
        integer dot products, read where the native library cannot be loaded)."""
        super().__setstate__(state)
        if "tuning" in state:
            for name in ("w1", "w2", "w3"):
                setattr(self, name, laid_out_again(getattr(self, name), self.tuning))
            self.swapped_in(self.tuning)

    def _apply(self, fn, *args, **kwargs):
        """``model.to(...)`` and the like: the weights' dtype may change, and with it the strategy."""
        module = super()._apply(fn, *args, **kwargs)
        if hasattr(self, "tuning"):  # swapped in already
            self.swapped_in(self.tuning)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (T, D)
        kind = triton_experts_kind(self, x) if self.strategy.triton else None
        if kind is not None:
            return triton_mixture(self, x, *self.route(x), kind)  # (all the experts are here: nothing to reduce)
        if self.strategy.float_experts and takes_rows(self, x):  # decode batches: the package's float32 operator
            return float_experts(self, x, *self.route(x))
        return super().forward(x)

    def expert(self, e: int | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return expert(self, e, x, self.tuning)

    def decode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The mixture on rows of one token each, x ``(B, D)``, in fixed shapes (``MoeStrategy``): ``(B, D)``."""
        return self.strategy.decode_rows(self, x)


class ReferenceQuantizedMoeLayer(MoeLayer):
    """Quantized experts, read the readable way: each expert dequantized, then ``F.linear``."""

    def expert(self, e: int | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        def weight(stacked: QuantizedWeight) -> torch.Tensor:
            return stacked[e].dequantize(x.dtype)

        hidden = F.silu(F.linear(x, weight(self.w1))) * F.linear(x, weight(self.w3))
        return F.linear(hidden, weight(self.w2))


def moe_class(module: MoeLayer, fast: bool) -> type:
    """The module for a MoE layer: ``FastMoeLayer``, or the reference (quantized experts read by
    ``ReferenceQuantizedMoeLayer``) for ``Tuning(fast=False)``."""
    if fast:
        return FastMoeLayer
    return ReferenceQuantizedMoeLayer if isinstance(module.w1, QuantizedWeight) else MoeLayer

