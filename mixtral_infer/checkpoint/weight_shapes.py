"""The tensors a model's published checkpoint holds and the shape of each, from ModelArgs alone.

Loading asks this before reading a tensor's bytes, so a checkpoint whose tensor
does not fit the model (a wrong shape, a name the model has no place for) is
refused from its header, before memory is spent on it. Published names, with D
model dim, V vocabulary, H query heads, K KV heads, Dh head dim, I hidden dim,
E experts::

    tok_embeddings.weight, output.weight                    (V, D)
    norm.weight, layers.{i}.attention_norm.weight / ffn_norm (D,)
    layers.{i}.attention.wq.weight                           (H*Dh, D)
    layers.{i}.attention.wk.weight / wv.weight               (K*Dh, D)
    layers.{i}.attention.wo.weight                           (D, H*Dh)
    layers.{i}.feed_forward.w1.weight / w3.weight            (I, D)   dense
    layers.{i}.feed_forward.w2.weight                        (D, I)   dense
    layers.{i}.feed_forward.gate.weight                      (E, D)   MoE
    layers.{i}.feed_forward.experts.{j}.w1 / w3 .weight      (I, D)   MoE
    layers.{i}.feed_forward.experts.{j}.w2.weight            (D, I)   MoE
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from mixtral_infer.errors import CheckpointError
from mixtral_infer.model.transformer import ModelArgs

Shape = Tuple[int, ...]

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^feed_forward\.experts\.(\d+)\.(w[123])\.weight$")


def published_shape(name: str, args: ModelArgs) -> Optional[Shape]:
    """The shape of published tensor ``name`` in a model of ``args``; None when it has no such tensor.

    >>> from mixtral_infer.model.moe import MoeArgs
    >>> args = ModelArgs(dim=64, n_layers=2, head_dim=16, hidden_dim=96, n_heads=4, n_kv_heads=2,
    ...                  norm_eps=1e-5, vocab_size=128, moe=MoeArgs(4, 2))
    >>> published_shape("layers.1.attention.wk.weight", args), published_shape("layers.2.ffn_norm.weight", args)
    ((32, 64), None)
    """
    d, v, i = args.dim, args.vocab_size, args.hidden_dim
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    if name in ("tok_embeddings.weight", "output.weight"):
        return (v, d)
    if name == "norm.weight":
        return (d,)
    match = _LAYER.match(name)
    if match is None or int(match[1]) >= args.n_layers:
        return None
    rest = match[2]
    shapes = {
        "attention_norm.weight": (d,),
        "ffn_norm.weight": (d,),
        "attention.wq.weight": (q, d),
        "attention.wk.weight": (kv, d),
        "attention.wv.weight": (kv, d),
        "attention.wo.weight": (d, q),
    }
    if args.moe is None:
        shapes.update({"feed_forward.w1.weight": (i, d), "feed_forward.w3.weight": (i, d), "feed_forward.w2.weight": (d, i)})
    else:
        shapes["feed_forward.gate.weight"] = (args.moe.num_experts, d)
        expert = _EXPERT.match(rest)
        if expert is not None and int(expert[1]) < args.moe.num_experts:
            return (d, i) if expert[2] == "w2" else (i, d)
    return shapes.get(rest)


def check_shape(name: str, shape: Shape, expected: Optional[Shape], source: str) -> None:
    """Raise CheckpointError unless ``expected`` (None: the model has no such tensor) is ``shape``."""
    if expected is None:
        raise CheckpointError(f"{source}: unexpected tensor {name}")
    if tuple(shape) != expected:
        raise CheckpointError(f"{source}: tensor {name} has shape {tuple(shape)}, the model config implies {expected}")


def check_published_shape(name: str, shape: Shape, args: ModelArgs, source: str) -> None:
    """Raise CheckpointError unless the model has a tensor ``name`` of this shape."""
    check_shape(name, shape, published_shape(name, args), source)
