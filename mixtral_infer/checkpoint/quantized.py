"""Quantized weights in the stream of published tensors: made while loading, or read from a folder.

Loading with ``quantize=`` turns each float weight into a ``QuantizedWeight`` as it is read,
before the next one is read, so memory holds the quantized model plus one float tensor (the
experts of a layer are quantized one by one, then stacked). A folder written by
``convert --quantize`` holds, under a quantized weight's published name ``X.weight``, the
integers, and under ``X.scales`` the scales; its ``params.json`` says
``"quantization": {"scheme": "int8"}``, and it loads without quantizing again. The safetensors
file records the same under its ``__metadata__`` key ``quantization``, so that an edited
``params.json`` is refused (``check_recorded_scheme``): int4 and nf4 store alike shaped bytes, and
read as the other they decode nonsense without any error.

Worked example, int4 with groups of 32, published ``layers.0.attention.wq.weight`` of shape
(4096, 4096): the folder holds ``layers.0.attention.wq.weight`` uint8 (4096, 2048) and
``layers.0.attention.wq.scales`` bfloat16 (4096, 128).
"""

from __future__ import annotations

import json
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from mixtral_infer.checkpoint.weight_shapes import check_shape, published_shape
from mixtral_infer.errors import CheckpointError, ConfigError
from mixtral_infer.memory import release_freed_memory
from mixtral_infer.checkpoint.shares import Selection
from mixtral_infer.model.transformer import ModelArgs
from mixtral_infer.fast.int4_inline import with_float32_scales
from mixtral_infer.kernels.linear import prepare_weight
from mixtral_infer.quant.model import (
    check_stored_scales,
    is_quantized_published,
    quantize_tensor,
    scales_name,
    stored_shapes,
)
from mixtral_infer.quant.model import weight_name as weight_name_of  # weight_name is a local name here
from mixtral_infer.quant.weights import SCALE_DTYPE, QuantizedWeight, QuantScheme, quantize
from mixtral_infer.tuning import Tuning

PARAMS_KEY = "quantization"
METADATA_KEY = "quantization"  # in the safetensors file's __metadata__: the scheme's params, as JSON

Tensors = Iterator[Tuple[str, torch.Tensor]]


def quantize_published(tensors: Tensors, scheme: QuantScheme, dtype: torch.dtype, device: torch.device,
                       tuning: Tuning = Tuning()) -> Iterator:  # fmt: skip
    """Published (name, float tensor) -> (name, QuantizedWeight) for the weights that are quantized,
    in the layout of the back-end that reads them under ``tuning`` (``prepare_weight``), scales in
    ``dtype``; other tensors, and weights that come quantized already (a GGUF file's Q4_0 blocks kept
    as int4 when asked for int4), pass unchanged."""
    for name, tensor in tensors:
        if is_quantized_published(name) and not isinstance(tensor, QuantizedWeight):
            weight = prepare_weight(quantize_tensor(tensor, scheme, dtype, device, name), tuning)
            del tensor
            release_freed_memory()
            yield name, weight
        else:
            yield name, tensor


def to_stored(tensors: Tensors, scheme: QuantScheme) -> Tensors:
    """Published float tensors -> what a quantized folder holds: ``X.weight`` integers, ``X.scales``."""
    for name, tensor in tensors:
        if not is_quantized_published(name):
            yield name, tensor
        elif tensor.is_meta:  # the writers' plan: shapes and dtypes only
            values_shape, scales_shape = stored_shapes(name, tuple(tensor.shape), scheme)
            integers = torch.int8 if scheme.name == "int8" else torch.uint8
            yield name, torch.empty(values_shape, dtype=integers, device="meta")
            yield scales_name(name), torch.empty(scales_shape, dtype=SCALE_DTYPE, device="meta")
        else:
            weight = quantize(tensor, scheme, SCALE_DTYPE, name)
            yield name, weight.values
            yield scales_name(name), weight.scales


def from_stored(tensors: Tensors, scheme: QuantScheme, dtype: torch.dtype, device: torch.device, source: str,
                tuning: Tuning = Tuning()) -> Iterator:  # fmt: skip
    """The inverse of ``to_stored``: each ``X.weight`` with its ``X.scales`` as one QuantizedWeight."""
    waiting: Dict[str, torch.Tensor] = {}  # name -> the half of a pair that came first
    for name, tensor in tensors:
        weight_name = weight_name_of(name)
        if not is_quantized_published(weight_name):
            yield name, tensor
            continue
        other = scales_name(weight_name) if name == weight_name else weight_name
        if other not in waiting:
            waiting[name] = tensor
            continue
        values, scales = (tensor, waiting.pop(other)) if name == weight_name else (waiting.pop(other), tensor)
        expected = torch.int8 if scheme.name == "int8" else torch.uint8
        if values.dtype != expected:
            raise CheckpointError(f"{source}: {weight_name} has dtype {values.dtype}, {scheme.name} stores {expected}")
        if not scales.is_floating_point():
            name = scales_name(weight_name)
            raise CheckpointError(f"{source}: {name} has dtype {scales.dtype}, expected floating point")
        check_stored_scales(scales_name(weight_name), scales, scheme, dtype, source)  # before the cast to dtype
        in_features = values.shape[-1] * (2 if scheme.four_bit else 1)
        weight = QuantizedWeight(scheme, values.to(device), scales.to(device=device, dtype=dtype), in_features)
        weight = prepare_weight(weight, tuning)  # the layout of the back-end that reads it
        del values, scales, tensor
        release_freed_memory()
        yield weight_name, weight
    if waiting:
        name = sorted(waiting)[0]
        missing = scales_name(name) if name.endswith(".weight") else weight_name_of(name)
        raise CheckpointError(f"{source}: {name} has no partner: {missing} is missing")


def stored_select(select: Callable[[str], Optional[Selection]], scheme: QuantScheme) -> Callable[[str], Optional[Selection]]:
    """A rank's share of a quantized folder's tensors, from ``select``, the share of the float weights.

    Rows (output units) are cut alike in the integers and the scales. Columns (inputs: ``wo`` and
    ``w2`` under tensor parallelism) are elements of int8 integers, bytes of int4 and nf4 ones (two
    inputs each), groups of their scales, and none of int8 scales: one scale per output row, computed over
    the whole row, so each rank's share of a row keeps it (and the model equals the one-process one).
    Example, int4 groups of 32, a rank keeping inputs 2048:4096 of ``wo``: integers columns
    1024:2048, scales columns 64:128.
    """

    def pick(name: str) -> Optional[Selection]:
        weight_name = weight_name_of(name)
        if not is_quantized_published(weight_name):
            return select(name)
        part = select(weight_name)
        if part is None or part.columns is None:
            return part
        columns = part.columns
        if name.endswith(".scales"):
            per = scheme.group_size
            return Selection(part.rows, None if per is None else slice(columns.start // per, columns.stop // per))
        if scheme.four_bit:
            return Selection(part.rows, slice(columns.start // 2, columns.stop // 2))
        return part

    return pick


def check_stored_shape(name: str, shape: Tuple[int, ...], args: ModelArgs, scheme: QuantScheme, source: str) -> None:
    """The shape check of ``weight_shapes`` for a quantized folder: integers and scales of each weight."""
    weight_name = weight_name_of(name)
    expected = published_shape(weight_name, args)
    if expected is not None and is_quantized_published(weight_name):
        values_shape, scales_shape = stored_shapes(weight_name, expected, scheme)
        expected = scales_shape if name.endswith(".scales") else values_shape
    elif name != weight_name:
        expected = None  # scales of a weight that is not quantized
    check_shape(name, shape, expected, source)


def stack(parts: List) -> torch.Tensor | QuantizedWeight:
    """``torch.stack`` of the experts of a layer, float tensors or QuantizedWeights."""
    if not isinstance(parts[0], QuantizedWeight):
        return torch.stack(parts)
    first = parts[0]
    if first.holds_inline_scales() and len({p.packed[0].shape for p in parts}) > 1:  # some experts' scales not bfloat16
        parts = [QuantizedWeight(p.scheme, p.values, p.scales, p.in_features,
                                 (with_float32_scales(p.packed[0], p.in_features, p.scheme.group_size), p.packed[1]))
                 for p in parts]  # fmt: skip
    values = None if first.values is None else torch.stack([p.values for p in parts])
    packed = None if first.packed is None else tuple(torch.stack(ts) for ts in zip(*(p.packed for p in parts)))
    return QuantizedWeight(first.scheme, values, torch.stack([p.scales for p in parts]), first.in_features, packed)


def scheme_from_params(params: dict, source: str) -> Optional[QuantScheme]:
    """Remove and parse ``params["quantization"]``; None for a float checkpoint."""
    value = params.pop(PARAMS_KEY, None)
    try:
        return QuantScheme.parse(value)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def recorded(scheme: QuantScheme) -> Dict[str, str]:
    """The safetensors ``__metadata__`` of a folder quantized as ``scheme``."""
    return {METADATA_KEY: json.dumps(scheme.to_params(), sort_keys=True)}


def check_recorded_scheme(metadata: Dict[str, str], stored: Optional[QuantScheme], path: str, params_path: str) -> None:
    """The scheme a quantized file was written in (its ``__metadata__``) against ``params.json``'s,
    ``stored``. Where they differ, or params.json lost its entry, the folder was edited: refused,
    before any tensor is read. Files without the record (float ones, and quantized folders written
    before it) pass. w8a8 and int8 are the same tensors, so activations are not compared.

    Example: a folder written by ``convert --quantize int4`` whose params.json was edited to
    ``{"scheme": "nf4", "group_size": 32}``: "... was written as int4 (groups of 32), but ...
    params.json says nf4 (groups of 32)"."""
    record = metadata.get(METADATA_KEY)
    if record is None:
        return
    try:
        written = QuantScheme.parse(json.loads(record))
    except (ValueError, ConfigError):
        message = f"{path}: its recorded quantization {record!r} is not a scheme: write it again (convert --quantize)"
        raise CheckpointError(message) from None
    entry = json.dumps({PARAMS_KEY: written.to_params()})[1:-1]
    if stored is None:
        raise CheckpointError(f"{path} holds weights quantized as {written.label}, but {params_path} has no "
                              f"{PARAMS_KEY!r} entry: the folder was edited; put back {entry}")  # fmt: skip
    if (written.name, written.group_size) != (stored.name, stored.group_size):
        raise CheckpointError(f"{path} was written as {written.label}, but {params_path} says {stored.label}: the "
                              f"folder was edited; put back {entry}, or write it again (convert --quantize)")  # fmt: skip
