"""The weight back-ends of the model's linear layers, one file each, and the one table that says
which reads a weight.

Each back-end (``backend.LinearBackend``) is an ``nn.Linear`` with its own ``forward``: the weights
it reads, the layouts it prepares at load, and its kernels (or the library calls that are its
kernels). ``formats.modules.use_formats`` swaps in, for each linear layer, the first back-end of
``BACKENDS`` that takes its weight (``backend_for``), so the model's ``self.wq(x)`` runs that
back-end's product with no choice of kernel left but the call's own (rows, compiled or not):

==================  ==========================================  ============  =====================
back-end (file)     weights                                     devices       when
==================  ==========================================  ============  =====================
``reference``       any (quantized ones dequantized)            any           ``Tuning(fast=False)``
``triton``          dense int8, int4                            Triton's      ``Tuning.triton_dense``
``gemlite``         int8, int4 that GemLite packed at load      CUDA          GemLite installed
``w8a8``            int8 packed for fbgemm at load              CPU
``nf4``             nf4 (bitsandbytes' layouts)                 any
``int_dots``        int8; int4 with its scales inline           x86 CPU       ``Tuning.int_dots``
``int8``            int8 (column blocks on CPU, compiled)       any
``int4``            int4 (the device's kernel layout)           any
``packed_bf16``     bfloat16 in oneDNN's layout                 CPU           ``load_model(pack=True)``
``column_blocks``   float, long rows in blocks of columns       any           ``pack="columns"``
``plain``           a float ``nn.Parameter``                    any
==================  ==========================================  ============  =====================

Adding a back-end is a new file here with its ``LinearBackend`` subclass and one line in
``BACKENDS`` (docs/architecture.md, "Adding a weight back-end").

Loading prepares weights through the same table: ``prepare_weight`` as each weight is read (kernel
layouts written over the plain bytes, so the peak stays one weight), ``prepare_model`` once the
model is built (weights that go together, side by side). ``linear`` and ``linears`` multiply by a
bare weight through its back-end (the MoE layers choose their experts' once, when swapped in).
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from mixtral_infer.kernels.linear.backend import DEFAULT, LinearBackend, laid_out_for, put_weight
from mixtral_infer.kernels.linear.column_blocks import ColumnBlocksLinear
from mixtral_infer.kernels.linear.gemlite import GemliteLinear
from mixtral_infer.kernels.linear.int4 import Int4Linear
from mixtral_infer.kernels.linear.int8 import Int8Linear
from mixtral_infer.kernels.linear.int_dots import IntDotsLinear
from mixtral_infer.kernels.linear.nf4 import Nf4Linear
from mixtral_infer.kernels.linear.packed_bf16 import PackedBf16Linear
from mixtral_infer.kernels.linear.plain import PlainLinear, few_row_blocks
from mixtral_infer.kernels.linear.reference import ReferenceLinear, reference_linear
from mixtral_infer.kernels.linear.triton import TritonDenseLinear
from mixtral_infer.kernels.linear.w8a8 import W8a8Linear
from mixtral_infer.tuning import Tuning

# Asked in this order; the first that takes a weight reads it (a line per back-end).
BACKENDS = (
    ReferenceLinear,
    TritonDenseLinear,
    GemliteLinear,
    W8a8Linear,
    Nf4Linear,
    IntDotsLinear,
    Int8Linear,
    Int4Linear,
    PackedBf16Linear,
    ColumnBlocksLinear,
    PlainLinear,
)


def backend_for(weight: object, tuning: Tuning = DEFAULT) -> type:
    """The back-end that reads ``weight`` under ``tuning``: the first of ``BACKENDS`` that takes it."""
    for backend in BACKENDS:
        if backend.takes(weight, tuning):
            return backend
    raise TypeError(f"no weight back-end reads a {type(weight).__name__} on {getattr(weight, 'device', '?')}")


def prepare_weight(weight, tuning: Tuning = DEFAULT, keep_values: bool = False):
    """Lay out one weight as it is read, in place, for the first back-end of the table that lays it
    out (``LinearBackend.prepare``; the reference keeps the plain layout); returns it."""
    for backend in BACKENDS:
        if backend.wanted(tuning) and backend.prepare(weight, tuning, keep_values):
            break
    return weight


def laid_out_again(weight, tuning: Tuning = DEFAULT):
    """``laid_out_for`` the back-end that reads ``weight`` under ``tuning`` here (``backend_for``)."""
    return laid_out_for(weight, backend_for(weight, tuning), tuning)


def prepare_model(model: nn.Module, tuning: Tuning, pack: bool | str = True) -> nn.Module:
    """Lay out a loaded model's weights that go together, in place, as each back-end wants
    (``LinearBackend.prepare_model``); nothing for the reference. ``pack``: ``load_model``'s."""
    for backend in BACKENDS:
        if backend.wanted(tuning):
            backend.prepare_model(model, tuning, pack)
    return model


def linear(x: torch.Tensor, weight, tuning: Tuning = DEFAULT) -> torch.Tensor:
    """``x (M, IN) @ weight (OUT, IN).T`` -> ``(M, OUT)`` through the back-end that reads ``weight``."""
    return backend_for(weight, tuning).product(x, weight, tuning)


def linears(x: torch.Tensor, *weights, tuning: Tuning = DEFAULT) -> List[torch.Tensor]:
    """``[linear(x, w, tuning) for w in weights]``, in one product where the back-end joined them at load."""
    return backend_for(weights[0], tuning).products(x, weights, tuning)


__all__ = [
    "BACKENDS",
    "DEFAULT",
    "ColumnBlocksLinear",
    "GemliteLinear",
    "Int4Linear",
    "Int8Linear",
    "IntDotsLinear",
    "LinearBackend",
    "Nf4Linear",
    "PackedBf16Linear",
    "PlainLinear",
    "ReferenceLinear",
    "TritonDenseLinear",
    "W8a8Linear",
    "backend_for",
    "few_row_blocks",
    "laid_out_again",
    "laid_out_for",
    "linear",
    "linears",
    "prepare_model",
    "prepare_weight",
    "put_weight",
    "reference_linear",
]
