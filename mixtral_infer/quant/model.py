"""Which of a Transformer's weights are quantized, and putting quantized weights in their place.

Quantized: the attention projections ``wq, wk, wv, wo``, the feed-forward ``w1, w2, w3``
(dense, or the stacked experts ``(E, I, D)``) and the output matrix: the matrices every
decoding step reads. Kept as they are: the embeddings (a lookup of one row per token, not
a matmul), the norms and the MoE router (small, and the routing decides which experts run).

A quantized weight replaces its ``nn.Parameter`` under the same attribute name, so
the module holding it becomes the one that reads it (``formats.modules``).

On disk (a folder written by ``convert --quantize``) a quantized weight is two tensors
under its published name: ``X.weight`` holds the integers (int8, or uint8 with two int4
or nf4 codes per byte) and ``X.scales`` the scales; ``params.json`` records the scheme as
``"quantization": {"scheme": "int4", "group_size": 32}``.
"""

from __future__ import annotations

import math
import re
from typing import Optional, Tuple

import torch
from torch import nn

from mixtral_infer.errors import CheckpointError, ConfigError
from mixtral_infer.quant.weights import QuantizedParameter, QuantizedWeight, QuantScheme, check_scales_fit, quantize

# Internal parameter names (experts stacked) and published names (one tensor per expert).
_QUANTIZED_INTERNAL = re.compile(r"^(output\.weight|layers\.\d+\.(attention\.w[qkvo]\.weight|feed_forward\.w[123](\.weight)?))$")
_QUANTIZED_PUBLISHED = re.compile(
    r"^(output|layers\.\d+\.(attention\.w[qkvo]|feed_forward\.w[123]|feed_forward\.experts\.\d+\.w[123]))\.weight$"
)


def is_quantized(name: str) -> bool:
    """Whether internal parameter ``name`` is quantized (``layers.0.feed_forward.w1``: yes; ``...gate.weight``: no)."""
    return _QUANTIZED_INTERNAL.match(name) is not None


def is_quantized_published(name: str) -> bool:
    """Whether published tensor ``name`` (``layers.0.feed_forward.experts.3.w1.weight``) is quantized."""
    return _QUANTIZED_PUBLISHED.match(name) is not None


def scales_name(published_weight_name: str) -> str:
    """``layers.0.attention.wq.weight`` -> ``layers.0.attention.wq.scales``."""
    return published_weight_name[: -len("weight")] + "scales"


def weight_name(published_name: str) -> str:
    """The weight a tensor of a quantized folder belongs to: ``layers.0.attention.wq.scales`` ->
    ``layers.0.attention.wq.weight``; any other name is its own."""
    return published_name[: -len("scales")] + "weight" if published_name.endswith(".scales") else published_name


def stored_shapes(name: str, shape: Tuple[int, ...], scheme: QuantScheme) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Shapes of the integers and the scales of published float weight ``name`` of ``shape`` (OUT, IN)."""
    scheme.check_shape(name, shape)
    out, inputs = shape
    if scheme.name == "int8":
        return (out, inputs), (out,)
    return (out, inputs // 2), (out, inputs // scheme.group_size)


def check_quantizable(args, scheme: QuantScheme, tensor_parallel: int = 1) -> None:
    """ConfigError, before any weight is read, when 4-bit groups do not divide a weight's inputs
    (with tensor parallelism, each rank's share of ``wo`` and ``w2`` inputs: ranks quantize their own)."""
    if scheme.group_size is None:
        return
    n = tensor_parallel
    for name, inputs in (("dim", args.dim), ("n_heads * head_dim", args.n_heads * args.head_dim // n), ("hidden_dim", args.hidden_dim // n)):
        if inputs % scheme.group_size:
            share = f" / tensor_parallel={n}" if n > 1 and name != "dim" else ""
            raise ConfigError(f"{name}{share} = {inputs} inputs is not a multiple of the {scheme.name} group size {scheme.group_size}: choose a group size that divides it")


def quantize_tensor(tensor: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype, device: torch.device,
                    name: str = "the weight") -> QuantizedWeight:  # fmt: skip
    """One weight quantized on ``device``, in the plain layout (the back-end that reads it lays it out
    for its kernels: ``kernels.linear.prepare_weight``)."""
    return quantize(tensor.to(device), scheme, dtype, name)


def check_finite_scales(name: str, scales: torch.Tensor, source: str,
                        remedy: str = "write it again (convert --quantize)") -> None:  # fmt: skip
    """CheckpointError when stored ``scales`` (``name``, read from ``source``) hold NaN or inf: the
    folder is damaged, and every product of the weight would be NaN or garbage, far from where it
    shows (bfloat16 attention on CPU can even hide a NaN key from the logits' check). Weights
    quantized here are checked by ``quantize``."""
    if bool(torch.isfinite(scales).all()):
        return
    raise CheckpointError(
        f"{source}: {name} holds NaN or infinite scales: the folder is damaged; {remedy}"
    )


def check_stored_scales(name: str, scales: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype, source: str) -> None:
    """``check_finite_scales``, and CheckpointError where stored ``scales`` are negative (``quantize``
    never writes one: the folder is damaged) or stand for weights beyond ``dtype``'s range (float16's
    65504: a scale turned inf, or 127 times an int8 scale past it, would make the products inf)."""
    if scales.numel() == 0:
        return
    smallest, largest = (float(v) for v in torch.aminmax(scales.float()))  # one pass: NaN and inf carry through
    if not (math.isfinite(smallest) and math.isfinite(largest)):
        check_finite_scales(name, scales, source)  # says so
    if smallest < 0:
        raise CheckpointError(f"{source}: {name} holds negative scales: the folder is damaged; write it again (convert --quantize)")
    check_scales_fit(f"{source}: {name}", largest, scheme, dtype, "load in bfloat16 or float32")


def quantized_numel(model: nn.Module) -> int:
    """How many weights a model holds quantized (``model.parameters()`` counts only the float ones)."""
    return sum(module.shape.numel() for module in model.modules() if isinstance(module, QuantizedParameter))


def model_scheme(model: nn.Module) -> Optional[QuantScheme]:
    """The scheme of a model's quantized weights, or None for a float model."""
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            return module.scheme
    return None
