"""Quantizing a model in memory, in place: each quantized weight takes its parameter's place, and
the module holding it becomes the one that reads it (``formats.modules.replace_parameter``).
Loading quantizes tensor by tensor instead (``checkpoint.quantized``), with ``install``.
"""

from __future__ import annotations

import torch
from torch import nn

from mixtral_infer.errors import ConfigError
from mixtral_infer.fast.cpu_packed import side_by_side_groups
from mixtral_infer.formats.modules import replace_parameter, tuning_of
from mixtral_infer.memory import release_freed_memory
from mixtral_infer.quant import int8_activations
from mixtral_infer.quant.kernels import nf4_layout
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
    float32_outputs = tuning_of(model).gemlite_float32_outputs  # GemLite's outputs (quant.gemlite_cuda)
    for name in [name for name, _ in model.named_parameters() if is_quantized(name)]:
        param = model.get_parameter(name)
        weight = quantize_tensor(param.data, scheme, param.dtype, param.device, name, gemlite_float32_outputs=float32_outputs)
        install(model, name, weight)
    join_side_by_side(model)  # nf4 on CPU: wq wk wv, and w1 w3, one kernel call each
    return int8_activations.pack_model(model)  # w8a8 on CPU: for fbgemm, wq wk wv and w1 w3 side by side


def join_side_by_side(model: nn.Module) -> nn.Module:
    """nf4 weights in the kernel's layout that multiply the same input (``wq wk wv``, ``w1 w3``;
    ``fast.cpu_packed.SIDE_BY_SIDE``) joined, in place: their bytes one matrix, rows after rows (the
    layout is blocked by 32 rows, so joined rows are the members' layouts one after the other), and
    their scales one ``(IN/G, OUT)`` matrix. ``quant.kernels.quantized_linears`` then multiplies a
    group in one call of the kernel instead of one a weight (a call costs about 8 us around the
    kernel: 57 calls a mistral-bench step, 33 joined). The group's first weight holds the joined
    tensors (``joined``); each weight's own bytes become a view of them (no second copy), its own
    scales stay (the kernel reads a weight's scales whole)."""
    modules = dict(model.named_modules())
    names = [name for name, module in modules.items()
             if isinstance(module, QuantizedParameter) and module.scheme.name == "nf4"
             and nf4_layout(module) == "cpu" and module.joined_rows is None]  # fmt: skip
    for group in side_by_side_groups(names, lambda name: modules[name].shape):
        members = [modules[name] for name in group]
        if len(members) < 2:
            continue
        values = torch.cat([m.kernel_values for m in members], dim=-2)  # (..., OUT_all, IN/2)
        members[0].joined_values = values
        members[0].joined_scales = torch.cat([m.kernel_scales for m in members], dim=-1)  # (..., IN/G, OUT_all)
        start = 0
        for member in members:
            stop = start + member.shape[-2]
            member.kernel_values = values[..., start:stop, :]
            member.joined_rows = (start, stop, values.shape[-2])
            start = stop
        release_freed_memory()  # the members' own bytes, now copied: their pages back to the system
    return model
