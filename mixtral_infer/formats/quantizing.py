"""Quantizing a model in memory, in place: each quantized weight takes its parameter's place, in the
layout its back-end reads (``kernels.linear.prepare_weight``), and the module holding it becomes that
back-end (``formats.modules.replace_parameter``).
Loading quantizes tensor by tensor instead (``checkpoint.quantized``), with ``install``.
"""

from __future__ import annotations

import torch
from torch import nn

from mixtral_infer.errors import ConfigError
from mixtral_infer.formats.modules import replace_parameter, tuning_of, use_formats
from mixtral_infer.kernels.linear import prepare_model, prepare_weight
from mixtral_infer.quant.model import is_quantized, quantize_tensor
from mixtral_infer.quant.weights import QuantizedParameter, QuantizedWeight, QuantScheme


def install(model: nn.Module, name: str, weight: QuantizedWeight) -> None:
    """Put ``weight`` where internal parameter ``name`` was (the parameter is removed)."""
    replace_parameter(model, name, QuantizedParameter(weight))


def quantize_model(model: nn.Module, scheme: QuantScheme | str) -> nn.Module:
    """Quantize a model already in memory, in place (loading does it tensor by tensor instead). A
    model quantized already is refused: its float weights are gone, and it stayed as it was."""
    scheme = QuantScheme.parse(scheme)
    done = next((module for module in model.modules() if isinstance(module, QuantizedParameter)), None)
    if done is not None:
        raise ConfigError(f"the model is quantized already ({done.scheme.label}): quantize its float original instead")
    # By name: a list of the parameters themselves would keep every float weight alive until the
    # end (Mixtral 8x7B on one GPU: 93 GB of bfloat16 beside 47 GB of int8); this way each float
    # weight is freed as its quantized one takes its place.
    tuning = tuning_of(model)  # the back-ends' layouts for it (kernels.linear)
    for name in [name for name, _ in model.named_parameters() if is_quantized(name)]:
        param = model.get_parameter(name)
        weight = prepare_weight(quantize_tensor(param.data, scheme, param.dtype, param.device, name), tuning)
        install(model, name, weight)
    prepare_model(model, tuning, pack=False)  # nf4 and w8a8 weights side by side: wq wk wv, and w1 w3
    return use_formats(model, tuning)
