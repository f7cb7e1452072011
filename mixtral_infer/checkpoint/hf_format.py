"""Translation between Hugging Face transformers' Mistral/Mixtral layout and the published one.

Two differences matter:

* Names: ``model.layers.{i}.self_attn.q_proj.weight`` is ``layers.{i}.attention.wq.weight``, etc.
* Rotary layout: the published weights rotate adjacent feature pairs ``(2j, 2j+1)``
  of each head; transformers rotates ``(j, j + head_dim/2)``. So the rows of
  ``wq`` and ``wk`` are permuted within each head. For head_dim 4, published rows
  ``[a0 b0 a1 b1]`` are ``[a0 a1 b0 b1]`` in transformers.

Experts come in two layouts: transformers 4.x files hold
``block_sparse_moe.experts.{j}.w1/w2/w3.weight``; transformers 5 fuses them into
``mlp.experts.gate_up_proj`` ``(E, 2I, D)`` (w1 rows, then w3 rows) and
``mlp.experts.down_proj`` ``(E, D, I)``.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Optional, Tuple

import torch

from mixtral_infer.checkpoint.params import checked_args
from mixtral_infer.checkpoint.weight_shapes import Shape, check_shape, published_shape
from mixtral_infer.errors import CheckpointError, ConfigError
from mixtral_infer.model.moe import MoeArgs
from mixtral_infer.checkpoint.shares import LAYER_TENSOR
from mixtral_infer.model.transformer import ModelArgs
from mixtral_infer.quant.weights import QuantizedWeight


def hf_rows_to_published(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute q/k projection rows (n_heads * head_dim, dim) from halves to adjacent pairs."""
    rows, dim = weight.shape
    head_dim = rows // n_heads
    return weight.view(n_heads, 2, head_dim // 2, dim).transpose(1, 2).reshape(rows, dim)


def published_rows_to_hf(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``hf_rows_to_published``."""
    rows, dim = weight.shape
    head_dim = rows // n_heads
    return weight.view(n_heads, head_dim // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


_MISSING = object()


def _field(config: dict, name: str, kinds: tuple, source: str, default: object = _MISSING) -> object:
    """``config[name]`` if it is one of ``kinds`` (bools are not numbers); ConfigError naming the field otherwise."""
    if name not in config or config[name] is None:
        if default is _MISSING:
            raise ConfigError(f"{source}: missing field {name!r}")
        return default
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, kinds):
        expected = " or ".join(kind.__name__ for kind in kinds)
        raise ConfigError(f"{source}: {name}={value!r} must be {'an' if expected[0] in 'aeiou' else 'a'} {expected}")
    return value


def args_from_hf_config(config: dict, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a transformers MistralConfig / MixtralConfig dict; ConfigError naming a bad field."""
    number = (int, float)
    n_heads = _field(config, "num_attention_heads", (int,), source)
    dim = _field(config, "hidden_size", (int,), source)
    if n_heads < 1:
        raise ConfigError(f"{source}: num_attention_heads={n_heads} must be a positive integer")
    rope = _field(config, "rope_parameters", (dict,), source, default={})
    check_computed_alike(config, rope, source)
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is None:  # transformers' default_theta of the config's class, not params.json's rule
        mixtral = config.get("model_type") == "mixtral" or "MixtralForCausalLM" in (config.get("architectures") or [])
        theta = 1e6 if mixtral else 10000.0
    n_layers = _field(config, "num_hidden_layers", (int,), source)
    moe = None
    if config.get("num_local_experts") is not None:
        moe = MoeArgs(
            num_experts=_field(config, "num_local_experts", (int,), source),
            num_experts_per_tok=_field(config, "num_experts_per_tok", (int,), source),
        )
    return checked_args(
        dict(
            dim=dim,
            n_layers=n_layers,
            head_dim=_field(config, "head_dim", (int,), source, default=dim // n_heads),
            hidden_dim=_field(config, "intermediate_size", (int,), source),
            n_heads=n_heads,
            n_kv_heads=_field(config, "num_key_value_heads", (int,), source, default=n_heads),
            norm_eps=_field(config, "rms_norm_eps", number, source, default=1e-6),  # MistralConfig's default
            vocab_size=_field(config, "vocab_size", (int,), source),
            rope_theta=theta,
            sliding_window=windows_from_layer_types(config, n_layers, source),
            moe=moe,
        ),
        source,
    )


LAYER_TYPES = {"full_attention": False, "sliding_attention": True}  # transformers' layer_types: windowed?


def windows_from_layer_types(config: dict, n_layers: int, source: str) -> object:
    """params.json's ``sliding_window`` from transformers' ``sliding_window`` and ``layer_types``: the
    window alone where there are no layer types (MistralConfig), else the shortest list of windows that
    repeats into the layers' (``None`` for a full-attention layer), or one value where they are all alike.

    >>> windows_from_layer_types({"sliding_window": 8, "layer_types": ["full_attention"] + 3 * ["sliding_attention"]}, 4, "c")
    [None, 8, 8, 8]
    """
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if types is None:
        return window
    if not isinstance(types, list) or len(types) != n_layers:
        raise ConfigError(f"{source}: layer_types must list one type for each of the num_hidden_layers={n_layers} layers")
    unknown = next((kind for kind in types if kind not in LAYER_TYPES), None)
    if unknown is not None:
        raise ConfigError(f"{source}: layer_types names {unknown!r}, expected one of {list(LAYER_TYPES)}")
    windows = [window if LAYER_TYPES[kind] else None for kind in types]
    period = next(p for p in range(1, n_layers + 1) if n_layers % p == 0 and windows == windows[:p] * (n_layers // p))
    return windows[0] if period == 1 else windows[:period]


ACTIVATIONS = ("silu", "swish")  # transformers' names of the SwiGLU's activation (swish is silu)


def check_computed_alike(config: dict, rope: dict, source: str) -> None:
    """ConfigError for what config.json may ask that this model does not compute, which it would
    otherwise ignore and give other logits than transformers': a RoPE scaling (linear, yarn, dynamic,
    llama3...), an activation other than SiLU. (An output matrix tied to the embeddings,
    ``tie_word_embeddings``, is read: ``Checkpoint.tied_output``.)"""
    scaling = config.get("rope_scaling")
    kinds = [rope.get("rope_type", "default")]
    if scaling is not None:
        kinds.append(scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling)
    unsupported = next((kind for kind in kinds if kind != "default"), None)
    if unsupported is not None:
        raise ConfigError(f"{source}: RoPE scaling rope_type={unsupported!r} is not computed here, only the default RoPE")
    act = config.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{source}: hidden_act={act!r}: only silu (SwiGLU) is computed here")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ATTENTION = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}
_DENSE = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_TOP_LEVEL = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
_LAYER_NAMES = [  # transformers' name within layer i -> the published one (a table read top to bottom)
    (re.compile(r"^input_layernorm\.weight$"), "attention_norm.weight"),
    (re.compile(r"^post_attention_layernorm\.weight$"), "ffn_norm.weight"),
    (re.compile(r"^self_attn\.([qkvo])_proj\.weight$"), r"attention.w\1.weight"),
    (re.compile(r"^mlp\.gate_proj\.weight$"), "feed_forward.w1.weight"),
    (re.compile(r"^mlp\.down_proj\.weight$"), "feed_forward.w2.weight"),
    (re.compile(r"^mlp\.up_proj\.weight$"), "feed_forward.w3.weight"),
    (re.compile(r"^(?:mlp|block_sparse_moe)\.gate\.weight$"), "feed_forward.gate.weight"),
    (re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$"), r"feed_forward.experts.\1.\2.weight"),
]
_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # transformers 5: (E, 2I, D) and (E, D, I)


def hf_name_to_published(name: str) -> Optional[str]:
    """The published name of transformers' tensor ``name`` (None for the fused experts and unknown names).

    >>> hf_name_to_published("model.layers.3.self_attn.k_proj.weight")
    'layers.3.attention.wk.weight'
    """
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _LAYER.match(name)
    if match is None:
        return None
    for pattern, replacement in _LAYER_NAMES:
        if pattern.match(match[2]):
            return f"layers.{match[1]}.{pattern.sub(replacement, match[2])}"
    return None


def hf_shape(name: str, args: ModelArgs) -> Optional[Shape]:
    """The shape of transformers' tensor ``name`` in a model of ``args``; None when it has no such tensor."""
    match = _LAYER.match(name)
    if match is not None and match[2] in _FUSED:
        if args.moe is None or int(match[1]) >= args.n_layers:
            return None
        e, d, i = args.moe.num_experts, args.dim, args.hidden_dim
        return (e, 2 * i, d) if match[2] == _FUSED[0] else (e, d, i)
    published = hf_name_to_published(name)
    return published_shape(published, args) if published is not None else None


_ROTARY_BUFFER = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def is_rotary_buffer(name: str) -> bool:
    """``rotary_emb.inv_freq``: a buffer older transformers saved with the weights, ``(head_dim/2,)``;
    the model computes its angles from rope_theta, so it is checked and skipped, as transformers does."""
    return _ROTARY_BUFFER.match(name) is not None


def check_hf_shape(name: str, shape: Shape, args: ModelArgs, source: str) -> None:
    """Raise CheckpointError unless the model has a transformers tensor ``name`` of this shape."""
    expected = (args.head_dim // 2,) if is_rotary_buffer(name) else hf_shape(name, args)
    check_shape(name, shape, expected, source)


def hf_to_published(tensors: Iterable[Tuple[str, torch.Tensor]], args: ModelArgs) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield published (name, tensor) pairs for transformers' (name, tensor) pairs, one at a time.

    Each tensor's shape is checked against ``args`` first (``check_hf_shape``): the row
    permutation and the split of fused experts need the shapes they were written for.
    """
    for name, tensor in tensors:
        if not isinstance(name, str):
            raise CheckpointError(f"tensor name {name!r} is not a string")
        check_hf_shape(name, tuple(tensor.shape), args, "transformers checkpoint")
        match = _LAYER.match(name)
        if match is not None and match[2] in _FUSED:
            prefix = f"layers.{match[1]}.feed_forward.experts"
            if match[2] == _FUSED[0]:
                hidden = tensor.shape[1] // 2
                for j in range(tensor.shape[0]):
                    yield f"{prefix}.{j}.w1.weight", tensor[j, :hidden]
                    yield f"{prefix}.{j}.w3.weight", tensor[j, hidden:]
            else:
                for j in range(tensor.shape[0]):
                    yield f"{prefix}.{j}.w2.weight", tensor[j]
            continue
        published = hf_name_to_published(name)
        if published.endswith("attention.wq.weight"):
            tensor = _rows_to_published(tensor, args.n_heads)
        elif published.endswith("attention.wk.weight"):
            tensor = _rows_to_published(tensor, args.n_kv_heads)
        yield published, tensor


def _rows_to_published(weight: torch.Tensor | QuantizedWeight, n_heads: int) -> torch.Tensor | QuantizedWeight:
    """``hf_rows_to_published`` of a float weight, or of a 4-bit one's codes and scales (read from a
    bitsandbytes folder: a row's codes and scales stay together)."""
    if not isinstance(weight, QuantizedWeight):
        return hf_rows_to_published(weight, n_heads)
    values, scales = (hf_rows_to_published(t, n_heads) for t in (weight.values, weight.scales))
    return QuantizedWeight(weight.scheme, values, scales, weight.in_features)


_PUBLISHED_ATTENTION = {v: k for k, v in _ATTENTION.items()}
_PUBLISHED_DENSE = {v: k for k, v in _DENSE.items()}


def published_to_hf(tensors: Iterable[Tuple[str, torch.Tensor]], args: ModelArgs) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield transformers' (name, tensor) pairs, experts in the per-expert 4.x layout published on the hub."""
    for name, tensor in tensors:
        if name == "tok_embeddings.weight":
            yield "model.embed_tokens.weight", tensor
        elif name == "norm.weight":
            yield "model.norm.weight", tensor
        elif name == "output.weight":
            yield "lm_head.weight", tensor
        elif (match := LAYER_TENSOR.match(name)) is not None:
            prefix, rest = f"model.layers.{match[1]}", match[2]
            parts = rest.split(".")
            if rest == "attention_norm.weight":
                yield f"{prefix}.input_layernorm.weight", tensor
            elif rest == "ffn_norm.weight":
                yield f"{prefix}.post_attention_layernorm.weight", tensor
            elif parts[0] == "attention":
                if parts[1] == "wq":
                    tensor = published_rows_to_hf(tensor, args.n_heads)
                elif parts[1] == "wk":
                    tensor = published_rows_to_hf(tensor, args.n_kv_heads)
                yield f"{prefix}.self_attn.{_PUBLISHED_ATTENTION[parts[1]]}.weight", tensor
            elif rest == "feed_forward.gate.weight":
                yield f"{prefix}.block_sparse_moe.gate.weight", tensor
            elif parts[:2] == ["feed_forward", "experts"]:
                yield f"{prefix}.block_sparse_moe.experts.{parts[2]}.{parts[3]}.weight", tensor
            elif parts[0] == "feed_forward":
                yield f"{prefix}.mlp.{_PUBLISHED_DENSE[parts[1]]}.weight", tensor
            else:
                raise ValueError(f"no Hugging Face name for tensor {name}")
        else:
            raise ValueError(f"no Hugging Face name for tensor {name}")


def hf_config_from_args(args: ModelArgs, dtype: torch.dtype) -> dict:
    """A config.json dict that transformers reads as MistralConfig / MixtralConfig, or MinistralConfig
    (``layer_types``) for a model whose layers are not all alike (full attention beside windows)."""
    windows = args.layer_windows
    alternating = len(set(windows)) > 1
    if alternating and (args.moe is not None or len({w for w in windows if w is not None}) > 1):
        what = "experts" if args.moe is not None else f"several windows {sorted({w for w in windows if w is not None})}"
        raise ConfigError(f"sliding_window={args.sliding_window}: no transformers model has {what} with per-layer "
                          "attention; keep the Mistral layout (--to mistral)")  # fmt: skip
    architecture, model_type = (
        ("MixtralForCausalLM", "mixtral") if args.moe is not None
        else ("MinistralForCausalLM", "ministral") if alternating else ("MistralForCausalLM", "mistral")
    )  # fmt: skip
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "sliding_window": next((w for w in windows if w is not None), None),
        "max_position_embeddings": 32768,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if alternating:
        config["layer_types"] = ["sliding_attention" if w is not None else "full_attention" for w in windows]
    if args.moe is not None:
        config["num_local_experts"] = args.moe.num_experts
        config["num_experts_per_tok"] = args.moe.num_experts_per_tok
    return config
