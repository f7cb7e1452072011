"""The readable reference of every weight: ``F.linear(x, the weight as floats)``.

``Tuning(fast=False)`` (``load_model(fast=False)``, ``MIXTRAL_INFER_REFERENCE=1``) keeps it for every
weight: quantized ones are dequantized for each product (``QuantizedWeight.dequantize``), plain
parameters stay in the model's own ``nn.Linear``. The fast back-ends are tested against it, and a
fast one hands a product to it where its kernels do not apply (a dtype they are not vectorised for,
a layout made for another device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning


def reference_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x (M, IN) @ dequantize(weight).T`` -> ``(M, OUT)``: the readable path the kernels must equal."""
    return F.linear(x, weight.dequantize(x.dtype))


class ReferenceLinear(LinearBackend):
    """Any weight, read the readable way (module docstring)."""

    @classmethod
    def wanted(cls, tuning: Tuning) -> bool:
        return not tuning.fast

    @classmethod
    def reads(cls, weight: object) -> bool:
        return True

    @classmethod
    def prepare(cls, weight: object, tuning: Tuning, keep_values: bool = False) -> bool:
        return cls.wanted(tuning)  # the plain layout, which the reference reads: no back-end lays it out

    @classmethod
    def swapped_in(cls, module: nn.Linear, tuning: Tuning) -> None:
        if isinstance(module.weight, torch.Tensor):
            module.__class__ = nn.Linear  # a plain parameter: the model's own module
            module.tuning = tuning
        else:
            super().swapped_in(module, tuning)

    @staticmethod
    def product(x: torch.Tensor, weight, tuning: Tuning = DEFAULT) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            return reference_linear(x, weight)
        return F.linear(x, weight if isinstance(weight, torch.Tensor) else weight.dense())
