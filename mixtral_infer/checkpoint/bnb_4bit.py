"""Hugging Face folders quantized by bitsandbytes to 4-bit NF4 (``load_in_4bit``), read as nf4 weights.

Many checkpoints on the hub are saved this way (``BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4")``): ``config.json`` says ``"quantization_config": {"quant_method":
"bitsandbytes", "load_in_4bit": true, "bnb_4bit_quant_type": "nf4", ...}``, and each quantized
``nn.Linear`` weight ``X.weight`` is stored as bitsandbytes' ``Params4bit`` with its quant state:

* ``X.weight``: uint8 ``(OUT * IN / 2, 1)``, the codes of the flattened weight two a byte, the
  first of each pair in the high nibble (``nf4.cuda_layout``: bitsandbytes' own format);
* ``X.weight.absmax``: one scale per block of ``blocksize`` consecutive values, float32; or, with
  double quantization (``bnb_4bit_use_double_quant``), uint8 codes of the scales' own 8-bit
  quantization: ``absmax[i] = nested_quant_map[code[i]] * nested_absmax[i // nested_blocksize] +
  nested_offset``, with ``X.weight.nested_absmax`` and ``X.weight.nested_quant_map`` beside it;
* ``X.weight.quant_map``: the 16 code values (NF4's, ``nf4.NF4``);
* ``X.weight.quant_state.bitsandbytes__nf4``: the rest as JSON bytes, e.g. ``{"quant_type": "nf4",
  "blocksize": 64, "dtype": "bfloat16", "shape": [4096, 4096], "nested_blocksize": 256,
  "nested_offset": 0.0117, "nested_dtype": "float32"}``.

A block of the flattened weight is a group of one row when ``blocksize`` divides IN: then the
weight is this package's nf4 with ``group_size = blocksize`` and scales the blocks' absmax,
rounded to bfloat16 as every scale here is (a relative change of at most 2^-9 of a weight).
Worked example, OUT = 1, IN = 32, blocksize 32: codes ``[15, 2, 9, 7, 7, ...]`` are stored as
bytes ``[15 << 4 | 2, 9 << 4 | 7, 7 << 4 | 7, ...] = [242, 151, 119, ...]`` (plain layout ``[47,
121, 119, ...]``), absmax ``[0.5]``: the weight ``[0.5, -0.2625, 0.0805, 0.0, 0.0, ...]``
(``quant/nf4.py``'s example). Weights this package does not quantize (a Mixtral's
router) are dequantized to floats; weights stored as floats (the output matrix, by default)
stay floats.
"""

from __future__ import annotations

import json
import math
from typing import Dict, Iterator, Optional, Tuple

import torch

from mixtral_infer.checkpoint.hf_format import check_hf_shape, hf_shape
from mixtral_infer.errors import CheckpointError, ConfigError
from mixtral_infer.model.transformer import ModelArgs
from mixtral_infer.quant import nf4
from mixtral_infer.kernels.linear import prepare_weight
from mixtral_infer.quant.model import check_finite_scales
from mixtral_infer.quant.scheme import DEFAULT_GROUP_SIZES, INT4_GROUP_SIZES, QuantScheme
from mixtral_infer.quant.weights import SCALE_DTYPE, QuantizedWeight
from mixtral_infer.tuning import Tuning

STATE = "quant_state.bitsandbytes__nf4"
PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", STATE)  # beside X.weight, as X.weight.PART
NESTED = ("nested_absmax", "nested_quant_map")
REQUIRED = frozenset({"", "absmax", "quant_map", STATE})  # every weight's parts ("": the packed codes X.weight)

Tensors = Iterator[Tuple[str, torch.Tensor]]


def scheme_from_config(config: dict, source: str) -> Optional[QuantScheme]:
    """nf4 (its group size read later, from the first weight's quant state) when ``config.json``
    says bitsandbytes quantized the weights to 4-bit NF4; None when it says nothing of
    quantization; ConfigError for what cannot be read here (FP4, 8-bit, other methods)."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise ConfigError(f"{source}: quantization_config={quantization!r} must be an object")
    method = quantization.get("quant_method")
    if method is None:
        raise ConfigError(f"{source}: quantization_config has no quant_method: say which (bitsandbytes' 4-bit NF4 is "
                          "read), or remove it for float weights")  # fmt: skip
    if method != "bitsandbytes":
        raise ConfigError(
            f"{source}: weights quantized by {method!r}; only bitsandbytes' 4-bit NF4 is read: load the float original"
        )
    if quantization.get("load_in_8bit"):
        raise ConfigError(
            f"{source}: bitsandbytes 8-bit (LLM.int8) weights are not read: load the float original (--quantize int8)"
        )
    kind = quantization.get("bnb_4bit_quant_type", "fp4")
    if not quantization.get("load_in_4bit") or kind != "nf4":
        raise ConfigError(
            f"{source}: bitsandbytes 4-bit {kind!r} weights: only nf4 is read: load the float original (--quantize nf4)"
        )
    return QuantScheme("nf4", DEFAULT_GROUP_SIZES["nf4"])


def component(name: str) -> Optional[Tuple[str, str]]:
    """``(weight name, part)`` of a quant state tensor's name, or None for any other name:
    ``model.layers.0.self_attn.q_proj.weight.absmax`` -> ``("model.layers.0.self_attn.q_proj.weight", "absmax")``."""
    for part in PARTS:
        if name.endswith(".weight." + part):
            return name[: -len(part) - 1], part
    return None


def check_bnb_shape(name: str, shape: Tuple[int, ...], args: ModelArgs, source: str) -> None:
    """``check_hf_shape`` for a bitsandbytes folder, before anything is read: a quant state tensor
    must belong to a weight the model has (its own shapes are checked when it is decoded), and a
    weight's packed codes ``(OUT * IN / 2, 1)`` must fill its shape; float tensors as usual."""
    part = component(name)
    weight = part[0] if part is not None else name
    expected = hf_shape(weight, args)
    if part is not None and expected is not None:
        return
    packed = len(shape) == 2 and shape[1] == 1  # (OUT * IN / 2, 1)
    if part is None and expected is not None and packed and 2 * shape[0] == math.prod(expected):
        return
    check_hf_shape(name, shape, args, source)


def read_state(tensor: torch.Tensor, where: str) -> dict:
    """The JSON of a ``quant_state.bitsandbytes__nf4`` tensor."""
    try:
        state = json.loads(bytes(tensor.to(torch.uint8).flatten().tolist()).decode("utf-8"))
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested too deeply, a 5000-digit number
        raise CheckpointError(f"{where}: not bitsandbytes' JSON quant state ({type(error).__name__})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: not bitsandbytes' JSON quant state (a {type(state).__name__})")
    return state


def gathered(tensors: Tensors, source: str) -> Iterator[Tuple[str, torch.Tensor | QuantizedWeight]]:
    """Transformers' (name, tensor) pairs -> the same, each bitsandbytes weight as one nf4
    ``QuantizedWeight`` (plain layout, float32 scales rounded to bfloat16) once its packed codes and
    its quant state have all arrived (the parts of one weight may lie in different shards)."""
    waiting: Dict[str, Dict[str, torch.Tensor]] = {}
    schemes = set()  # one block size for the whole model: joined weights share one group size
    for name, tensor in tensors:
        part = component(name)
        weight, part = part if part is not None else (name, "")
        if weight not in waiting and not part and tensor.dtype != torch.uint8:
            yield name, tensor  # a float tensor (norms, embeddings, a matrix left unquantized)
            continue
        parts = waiting.setdefault(weight, {})
        parts[part] = tensor
        if REQUIRED <= parts.keys():
            nested = "nested_absmax" in parts or "nested_quant_map" in parts or parts["absmax"].dtype == torch.uint8
            if not nested or set(NESTED) <= parts.keys():
                del waiting[weight]
                quantized = decoded(weight, parts, source)
                schemes.add(quantized.scheme)
                if len(schemes) > 1:
                    sizes = sorted(scheme.group_size for scheme in schemes)
                    raise CheckpointError(
                        f"{source}: {weight}: blocks of {sizes[0]} and {sizes[1]} values in one model; "
                        "one block size is read"
                    )
                yield weight, quantized
    if waiting:
        weight, parts = sorted(waiting.items())[0]
        missing = sorted(REQUIRED - parts.keys())
        names = ", ".join(f"{weight}.{p}" if p else weight for p in missing) or f"{weight}.nested_absmax"
        raise CheckpointError(f"{source}: {weight}: bitsandbytes' 4-bit weight is incomplete: {names} missing")


def decoded(weight: str, parts: Dict[str, torch.Tensor], source: str) -> QuantizedWeight:
    """One bitsandbytes 4-bit weight (module docstring) as an nf4 ``QuantizedWeight``."""
    where = f"{source}: {weight}"
    state = read_state(parts[STATE], f"{where}.{STATE}")
    shape, blocksize = state.get("shape"), state.get("blocksize")
    if state.get("quant_type") != "nf4":
        raise CheckpointError(f"{where}: quant_type={state.get('quant_type')!r}, only nf4 is read")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(n, int) and n > 0 for n in shape)):
        raise CheckpointError(f"{where}: quant state shape={shape!r}, expected [OUT, IN]")
    out_features, in_features = shape
    codes = parts[""]
    if codes.dtype != torch.uint8 or codes.numel() * 2 != out_features * in_features:
        expected = out_features * in_features // 2
        raise CheckpointError(
            f"{where}: codes {tuple(codes.shape)} {codes.dtype}, the quant state's shape {shape} needs "
            f"{expected} uint8 bytes"
        )
    if blocksize not in INT4_GROUP_SIZES or in_features % blocksize:
        raise CheckpointError(
            f"{where}: blocks of {blocksize!r} values over {in_features} inputs: groups of one row of "
            f"{INT4_GROUP_SIZES} values are read (load the float original)"
        )
    quant_map = parts["quant_map"].to(torch.float32).flatten()
    if quant_map.numel() != 16 or not torch.allclose(quant_map, nf4.code_values(), atol=1e-6, rtol=0):
        raise CheckpointError(f"{where}.quant_map: not NF4's 16 values")
    blocks = out_features * in_features // blocksize
    absmax = _absmax(parts, state, blocks, where)  # (blocks,) float32
    scales = absmax.view(out_features, in_features // blocksize).to(SCALE_DTYPE).to(torch.float32)  # (OUT, IN/G)
    check_finite_scales(f"{weight}.absmax", scales, source, remedy="download it again")
    values = nf4.cuda_layout(codes.reshape(out_features, in_features // 2))  # (OUT, IN/2): the plain layout
    return QuantizedWeight(QuantScheme("nf4", blocksize), values, scales, in_features)


def _absmax(parts: Dict[str, torch.Tensor], state: dict, blocks: int, where: str) -> torch.Tensor:
    """Each block's scale, float32 ``(blocks,)``: stored, or decoded from double quantization."""
    absmax = parts["absmax"].flatten()
    if absmax.numel() != blocks:
        raise CheckpointError(f"{where}.absmax: {absmax.numel()} scales, the quant state implies {blocks}")
    if absmax.dtype != torch.uint8:
        if not absmax.is_floating_point():
            raise CheckpointError(f"{where}.absmax: dtype {absmax.dtype}, expected floating point or uint8")
        return absmax.to(torch.float32)
    nested_blocksize, offset = state.get("nested_blocksize"), state.get("nested_offset")
    if not isinstance(nested_blocksize, int) or nested_blocksize <= 0 or not isinstance(offset, (int, float)):
        raise CheckpointError(
            f"{where}: nested_blocksize={nested_blocksize!r}, nested_offset={offset!r} in its quant state"
        )
    code = parts["nested_quant_map"].to(torch.float32).flatten()
    nested = parts["nested_absmax"].to(torch.float32).flatten()
    if code.numel() != 256 or nested.numel() != math.ceil(blocks / nested_blocksize):
        raise CheckpointError(f"{where}: nested_quant_map of {code.numel()} and nested_absmax of {nested.numel()} "
                              f"values, expected 256 and {math.ceil(blocks / nested_blocksize)}")  # fmt: skip
    block_of = torch.arange(blocks) // nested_blocksize  # (blocks,)
    return code[absmax.long()] * nested[block_of] + offset  # as bitsandbytes' dequantize_4bit


def placed(tensors: Iterator[Tuple[str, torch.Tensor | QuantizedWeight]], quantized, dtype: torch.dtype,
           device: torch.device, tuning: Tuning = Tuning()) -> Iterator[Tuple[str, torch.Tensor | QuantizedWeight]]:  # fmt: skip
    """Published pairs with each nf4 weight on ``device`` in the layout of its back-end under ``tuning``, scales in
    ``dtype``; one this package keeps in floats (``quantized(name)`` false: a router) dequantized."""
    for name, tensor in tensors:
        if not isinstance(tensor, QuantizedWeight):
            yield name, tensor
        elif not quantized(name):
            yield name, tensor.dequantize(torch.float32)
        else:
            scales = tensor.scales.to(device=device, dtype=dtype)
            weight = QuantizedWeight(tensor.scheme, tensor.values.to(device), scales, tensor.in_features)
            yield name, prepare_weight(weight, tuning)
