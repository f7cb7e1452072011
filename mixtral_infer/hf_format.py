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
from typing import Dict, Iterable, Iterator, Tuple

import torch

from mixtral_infer.errors import ConfigError
from mixtral_infer.model import ModelArgs
from mixtral_infer.moe import MoeArgs


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


def args_from_hf_config(config: dict, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a transformers MistralConfig / MixtralConfig dict."""
    try:
        n_heads = config["num_attention_heads"]
        dim = config["hidden_size"]
        rope = config.get("rope_parameters") or {}
        theta = rope.get("rope_theta", config.get("rope_theta"))
        moe = None
        if "num_local_experts" in config:
            moe = MoeArgs(num_experts=config["num_local_experts"], num_experts_per_tok=config["num_experts_per_tok"])
        return ModelArgs(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            head_dim=config.get("head_dim") or dim // n_heads,
            hidden_dim=config["intermediate_size"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            norm_eps=config.get("rms_norm_eps", 1e-5),
            vocab_size=config["vocab_size"],
            rope_theta=theta,
            sliding_window=config.get("sliding_window"),
            moe=moe,
        )
    except KeyError as error:
        raise ConfigError(f"{source}: missing field {error.args[0]!r}") from None


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ATTENTION = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"}
_DENSE = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def hf_to_published(tensors: Iterable[Tuple[str, torch.Tensor]], args: ModelArgs) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield published (name, tensor) pairs for transformers' (name, tensor) pairs, one at a time."""
    for name, tensor in tensors:
        if name == "model.embed_tokens.weight":
            yield "tok_embeddings.weight", tensor
        elif name == "model.norm.weight":
            yield "norm.weight", tensor
        elif name == "lm_head.weight":
            yield "output.weight", tensor
        elif (match := _LAYER.match(name)) is not None:
            yield from _hf_layer_to_published(int(match[1]), match[2], tensor, args)
        else:
            yield name, tensor  # left for the caller's check to report as unexpected


def _hf_layer_to_published(
    layer: int, rest: str, tensor: torch.Tensor, args: ModelArgs
) -> Iterator[Tuple[str, torch.Tensor]]:
    prefix = f"layers.{layer}"
    parts = rest.split(".")
    if rest == "input_layernorm.weight":
        yield f"{prefix}.attention_norm.weight", tensor
    elif rest == "post_attention_layernorm.weight":
        yield f"{prefix}.ffn_norm.weight", tensor
    elif parts[0] == "self_attn" and parts[1] in _ATTENTION:
        if parts[1] == "q_proj":
            tensor = hf_rows_to_published(tensor, args.n_heads)
        elif parts[1] == "k_proj":
            tensor = hf_rows_to_published(tensor, args.n_kv_heads)
        yield f"{prefix}.attention.{_ATTENTION[parts[1]]}.weight", tensor
    elif parts[0] == "mlp" and parts[1] in _DENSE:
        yield f"{prefix}.feed_forward.{_DENSE[parts[1]]}.weight", tensor
    elif rest in ("mlp.gate.weight", "block_sparse_moe.gate.weight"):
        yield f"{prefix}.feed_forward.gate.weight", tensor
    elif rest == "mlp.experts.gate_up_proj":
        hidden = tensor.shape[1] // 2
        for j in range(tensor.shape[0]):
            yield f"{prefix}.feed_forward.experts.{j}.w1.weight", tensor[j, :hidden]
            yield f"{prefix}.feed_forward.experts.{j}.w3.weight", tensor[j, hidden:]
    elif rest == "mlp.experts.down_proj":
        for j in range(tensor.shape[0]):
            yield f"{prefix}.feed_forward.experts.{j}.w2.weight", tensor[j]
    elif parts[0] == "block_sparse_moe" and parts[1] == "experts":
        yield f"{prefix}.feed_forward.experts.{parts[2]}.{parts[3]}.weight", tensor
    else:
        yield f"model.layers.{layer}.{rest}", tensor


_PUBLISHED_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
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
        elif (match := _PUBLISHED_LAYER.match(name)) is not None:
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
    """A config.json dict that transformers reads as MistralConfig / MixtralConfig."""
    config = {
        "architectures": ["MixtralForCausalLM" if args.moe is not None else "MistralForCausalLM"],
        "model_type": "mixtral" if args.moe is not None else "mistral",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "sliding_window": args.sliding_window,
        "max_position_embeddings": 32768,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if args.moe is not None:
        config["num_local_experts"] = args.moe.num_experts
        config["num_experts_per_tok"] = args.moe.num_experts_per_tok
    return config
