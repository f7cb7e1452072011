"""A model's shape in files: ``params.json`` to ``ModelArgs`` and back, checked where it is read.

The model (``model.transformer.ModelArgs``) takes its shape as given; every shape that comes from
a file or an argument passes ``check_args`` here first, so a value no model can have is one
ConfigError naming its source (``params.json: n_heads=32 is not a multiple of n_kv_heads=6``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from mixtral_infer.errors import ConfigError
from mixtral_infer.model.moe import MoeArgs
from mixtral_infer.model.transformer import ModelArgs

MAX_LAYERS = 4096  # the largest published decoders have ~130 layers
MAX_SIZE = 2**31 - 1
NOT_THE_SHAPE = frozenset({"max_seq_len", "max_position_embeddings"})  # read by the server (loading.declared_max_len)  # every width, head and vocabulary count (torch sizes past 2**63 are a traceback)


def check_args(args: ModelArgs, source: str = "ModelArgs") -> ModelArgs:
    """``args``, or ConfigError on values no model can have, naming ``source``."""
    for name in ("dim", "n_layers", "head_dim", "hidden_dim", "n_heads", "n_kv_heads", "vocab_size", "max_batch_size"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{source}: {name}={value!r} must be a positive integer")
        if value > MAX_SIZE and name != "n_layers":  # n_layers: MAX_LAYERS below
            raise ConfigError(f"{source}: {name}={value} is more than 2**31 - 1, no model has a size that large")
    if args.n_layers > MAX_LAYERS:
        # Building the model makes Python objects per layer: 1e12 layers would hang, not fail.
        raise ConfigError(f"{source}: n_layers={args.n_layers} is more than {MAX_LAYERS}, no model has that many layers")
    for name in ("norm_eps", "rope_theta"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(f"{source}: {name}={value!r} must be a positive number")
    if args.n_heads % args.n_kv_heads != 0:
        raise ConfigError(
            f"{source}: n_heads={args.n_heads} is not a multiple of n_kv_heads={args.n_kv_heads}"
        )
    if args.head_dim % 2 != 0:
        raise ConfigError(f"{source}: head_dim={args.head_dim} must be even for rotary embeddings")
    check_windows(args.sliding_window, args.n_layers, source)
    if args.moe is not None:
        n, k = args.moe.num_experts, args.moe.num_experts_per_tok
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (n, k)):
            raise ConfigError(f"{source}: moe needs positive integers, got num_experts={n!r}, num_experts_per_tok={k!r}")
        if k > n:
            raise ConfigError(f"{source}: moe.num_experts_per_tok={k} exceeds moe.num_experts={n}")
        if n > MAX_SIZE:
            raise ConfigError(f"{source}: moe.num_experts={n} is more than 2**31 - 1, no model has that many experts")
    return args


def check_windows(sliding_window: object, n_layers: int, source: str) -> None:
    """``sliding_window`` is null, a positive integer, or a list of them (null: a full-attention layer)
    whose length divides ``n_layers`` (it is repeated over the layers, as mistral-inference reads it)."""
    def window(value: object) -> bool:
        return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)

    if isinstance(sliding_window, list):
        bad = next((value for value in sliding_window if not window(value)), "ok")
        if bad != "ok":
            raise ConfigError(f"{source}: sliding_window entry {bad!r} must be a positive integer or null (full attention)")
        if not sliding_window or n_layers % len(sliding_window) != 0:
            raise ConfigError(f"{source}: sliding_window lists {len(sliding_window)} windows, which does not divide "
                              f"n_layers={n_layers} (the list is repeated over the layers)")  # fmt: skip
    elif not window(sliding_window):
        raise ConfigError(f"{source}: sliding_window={sliding_window!r} must be a positive integer or null, or a list of them")


def args_from_params(params: dict, source: str = "params.json") -> ModelArgs:
    """Build from a params.json dict; unknown keys are ignored with a warning."""
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(params) - known - NOT_THE_SHAPE)
    if unknown:
        warnings.warn(f"{source}: ignoring unknown keys {unknown}", stacklevel=2)
    missing = [f.name for f in dataclasses.fields(ModelArgs) if f.default is dataclasses.MISSING and f.name not in params]
    if missing:
        raise ConfigError(f"{source}: missing required field(s) {missing}")
    fields = {key: value for key, value in params.items() if key in known}
    moe = fields.get("moe")
    if moe is not None:
        if not isinstance(moe, dict) or set(moe) - {"num_experts", "num_experts_per_tok"} or len(moe) != 2:
            raise ConfigError(f"{source}: moe must be {{'num_experts': int, 'num_experts_per_tok': int}}, got {moe!r}")
        fields["moe"] = MoeArgs(**moe)
    return checked_args(fields, source)


def checked_args(fields: dict, source: str) -> ModelArgs:
    """``ModelArgs(**fields)``, with ``source`` (the file) named in any ConfigError."""
    try:
        return check_args(ModelArgs(**fields), source)
    except TypeError as error:
        raise ConfigError(f"{source}: {error}") from None


def args_to_params(args: ModelArgs) -> dict:
    """The params.json dict (no null entries, no max_batch_size; a list of windows keeps its nulls)."""
    params = dataclasses.asdict(args)
    return {key: value for key, value in params.items() if value is not None and key != "max_batch_size"}
