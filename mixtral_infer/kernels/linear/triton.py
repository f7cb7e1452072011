"""int8 and int4 weights through our Triton kernels (``fast.triton_experts.dense_rows``), with
``Tuning.triton_dense``: the weight read as one expert, dequantized where it is read, for up to
``TRITON_DENSE_ROWS`` rows; products of more rows (prompts), and activations of another dtype than
the scales', take the weight's own back-end (``int8``, ``int4``). Where Triton runs: on a GPU, or on
CPU under its interpreter (the tests). Whether it beats GemLite and PyTorch's kernels is measured by
``bench/gpu_lease.sh`` (docs/performance.md).
"""

from __future__ import annotations

from typing import Optional

import torch

from mixtral_infer.fast import triton_experts
from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend
from mixtral_infer.kernels.linear.int4 import Int4Linear
from mixtral_infer.kernels.linear.int8 import Int8Linear
from mixtral_infer.quant.weights import QuantizedWeight
from mixtral_infer.tuning import Tuning

TRITON_DENSE_ROWS = 64  # products of more rows (prompts) take the weight's own back-end


def triton_weight_kind(weight: QuantizedWeight) -> Optional[int]:
    """The kind ``fast.triton_experts`` reads ``weight`` as (``INT8``, ``INT4``), or None where its
    kernels do not take it: nf4, int8 with int8 activations, without its plain values, or one expert of
    stacked weights (``weight.expert``)."""
    if weight.scheme.activations is not None or weight.values is None or weight.expert is not None:
        return None
    return {"int8": triton_experts.INT8, "int4": triton_experts.INT4}.get(weight.scheme.name)


def triton_dense_kind(x: torch.Tensor, weight: QuantizedWeight) -> Optional[int]:
    """The kind ``fast.triton_experts.dense_rows`` reads ``weight`` as (``triton_weight_kind``), or None
    where it does not take it: stacked weights, more than ``TRITON_DENSE_ROWS`` rows, other
    activations than the scales' dtype, no kernels here."""
    if x.dim() != 2 or x.shape[0] > TRITON_DENSE_ROWS or x.dtype != weight.dtype or len(weight.shape) != 2:
        return None
    return triton_weight_kind(weight) if triton_experts.runs_kernels(x.device) else None


class TritonDenseLinear(LinearBackend):
    """A dense int8 or int4 weight through ``dense_rows`` (module docstring)."""

    @classmethod
    def wanted(cls, tuning: Tuning) -> bool:
        return tuning.fast and tuning.triton_dense

    @classmethod
    def reads(cls, weight: object) -> bool:
        return isinstance(weight, QuantizedWeight) and len(weight.shape) == 2 and triton_weight_kind(weight) is not None

    @staticmethod
    def product(x: torch.Tensor, weight: QuantizedWeight, tuning: Tuning = DEFAULT) -> torch.Tensor:
        kind = triton_dense_kind(x, weight)
        if kind is not None:
            return triton_experts.dense_rows(x, weight.values, weight.scales, kind)
        return (Int8Linear if weight.scheme.name == "int8" else Int4Linear).product(x, weight, tuning)
