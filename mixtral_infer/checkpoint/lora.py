"""LoRA adapters, merged into the weights as they are loaded.

An adapter holds, for some of the model's matrices ``W`` (out, in), two small ones: ``A`` (r, in) and
``B`` (out, r). The fine-tuned matrix is ``W + scale * (B @ A)``. Two layouts are read:

* **PEFT** (the Hugging Face hub's form): a folder with ``adapter_config.json`` and
  ``adapter_model.safetensors``, tensors named after transformers' modules,
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``. ``scale`` is
  ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), ``r`` and ``lora_alpha`` per module
  where ``rank_pattern`` / ``alpha_pattern`` name it. The names go through the same table as a
  transformers checkpoint's (``hf_format.hf_name_to_published``), and the rows of ``B`` for ``q_proj`` and
  ``k_proj`` through the same per-head permutation. ``fan_in_fan_out`` is ignored, as PEFT ignores
  it (with a warning) for ``nn.Linear`` layers: every Mistral and Mixtral projection is one.
  Mixtral's experts are read as transformers 4.x named them (``block_sparse_moe.experts.N.w1``);
  PEFT's ``target_parameters`` (LoRA over transformers 5's fused expert tensors) is refused.
* **mistral-inference / mistral-finetune**: a ``lora.safetensors`` with published names
  (``layers.0.attention.wq.lora_A.weight``), its scale from the ``lora`` section of a
  ``params.json`` beside it (``{"rank": 16, "scaling": 2.0}``), else 2.0, ``load_lora``'s default.

``lora_scale`` multiplies the adapter's own scale (1.0: as trained). Every name and shape is checked
against the model's ``ModelArgs`` from the files' headers (``open_adapter``) before any weight is read;
``merged`` then adds each update to its weight as the weight streams past, in float32, before the
weight is quantized or packed, so loading holds about one more weight than without an adapter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from mixtral_infer.checkpoint.hf_format import hf_name_to_published, hf_rows_to_published
from mixtral_infer.checkpoint.safetensors_reader import Selector, apply_selection, iter_tensors, read_header
from mixtral_infer.checkpoint.shares import Selection
from mixtral_infer.checkpoint.weight_shapes import published_shape
from mixtral_infer.errors import CheckpointError, ConfigError
from mixtral_infer.formats.adapters import attach_adapters
from mixtral_infer.json_file import read_object
from mixtral_infer.model.transformer import ModelArgs

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
MISTRAL_WEIGHTS = "lora.safetensors"
MISTRAL_PARAMS = "params.json"
MISTRAL_DEFAULT_SCALING = 2.0  # mistral-inference's load_lora(scaling=2.0)
PEFT_PREFIX = "base_model.model."

_LORA_NAME = re.compile(r"^(.+)\.lora_([AB])\.weight$")
_BASE_NAME = re.compile(r"^(.+)\.base_layer\.weight$")  # PEFT's save_embedding_layers: the whole weight, saved along
_REFUSED_PEFT = {  # adapter_config.json fields whose non-default values change what the merge computes
    "use_dora": "DoRA's magnitude vectors",
    "lora_bias": "LoRA biases",
    "target_parameters": "LoRA over parameters (transformers 5's fused experts)",
    "modules_to_save": "whole modules saved beside the adapter",
    "trainable_token_indices": "trained token rows",
    "layer_replication": "replicated layers",
}
NamedTensors = Iterator[Tuple[str, torch.Tensor]]


@dataclass
class Update:
    """The low-rank update of one published weight: ``scale * (B @ A)``."""

    a_name: str  # the tensors' names in the adapter file
    b_name: str
    scale: float
    permute_heads: int = 0  # transformers' q/k rows: permute B's rows per head to the published layout


@dataclass
class Adapter:
    """An adapter, opened and checked against a model: its file and each target's update. Nothing is read yet."""

    path: Path  # the safetensors file
    format: str  # "peft" or "mistral"
    updates: Dict[str, Update] = field(default_factory=dict)  # published weight name -> its update
    replaced: Dict[str, str] = field(default_factory=dict)  # published weight name -> the adapter's copy of it

    def factors(self) -> Dict[str, Tuple[torch.Tensor, torch.Tensor, float]]:
        """Each target's (B, A, scale), B's rows in the published layout (the factors are small: all are
        read at once; each product ``B @ A``, a weight's size, only as its weight passes)."""
        tensors = dict(iter_tensors(self.path, lambda name: None if name in self.replaced.values() else Selection()))
        factors = {}
        for name, update in self.updates.items():
            b = tensors[update.b_name]
            if update.permute_heads:
                b = hf_rows_to_published(b, update.permute_heads)
            for tensor_name, tensor in ((update.a_name, tensors[update.a_name]), (update.b_name, b)):
                if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
                    raise CheckpointError(f"{self.path}: tensor {tensor_name} holds {tensor.dtype} values that are not "
                                          "finite floating-point numbers")  # fmt: skip
            factors[name] = (b, tensors[update.a_name], update.scale)
        return factors


def find_adapter(path: str | Path) -> Tuple[str, Path, Optional[Path]]:
    """(format, weights file, configuration file) of the adapter at ``path``: a PEFT folder, a folder with
    ``lora.safetensors``, or a ``.safetensors`` file (PEFT when ``adapter_config.json`` lies beside it)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: LoRA adapter not found")
    folder = path if path.is_dir() else path.parent
    if path.is_dir() and (path / PEFT_CONFIG).is_file() or path.is_file() and path.name == PEFT_CONFIG:
        weights = folder / PEFT_WEIGHTS
        if not weights.is_file():
            other = " (adapter_model.bin, a pickle, is not read: save with safe_serialization)" if (folder / "adapter_model.bin").is_file() else ""
            raise CheckpointError(f"{weights}: file not found{other}")
        return "peft", weights, folder / PEFT_CONFIG
    if path.is_dir():
        if (path / MISTRAL_WEIGHTS).is_file():
            params = path / MISTRAL_PARAMS
            return "mistral", path / MISTRAL_WEIGHTS, params if params.is_file() else None
        raise CheckpointError(f"{path}: not a LoRA adapter (expected {PEFT_CONFIG} and {PEFT_WEIGHTS}, or {MISTRAL_WEIGHTS})")
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: not a LoRA adapter (expected a folder, or a .safetensors file)")
    if (folder / PEFT_CONFIG).is_file() and path.name == PEFT_WEIGHTS:
        return "peft", path, folder / PEFT_CONFIG
    params = folder / MISTRAL_PARAMS
    return "mistral", path, params if params.is_file() else None


def check_adapter_path(path: str | Path, lora_scale: float = 1.0) -> None:
    """The checks that need no model: the adapter exists, its format is known, ``lora_scale`` is a number."""
    _checked_scale(lora_scale)
    find_adapter(path)


def _checked_scale(lora_scale: object) -> float:
    if isinstance(lora_scale, bool) or not isinstance(lora_scale, (int, float)) or not math.isfinite(lora_scale):
        raise ConfigError(f"lora_scale={lora_scale!r} must be a finite number (1.0: the adapter as trained)")
    return float(lora_scale)


def open_adapter(path: str | Path, args: ModelArgs, lora_scale: float = 1.0) -> Adapter:
    """Read the adapter's configuration and header and check them against a model of ``args``: every
    tensor names a weight of the model, A is (r, in) and B (out, r) of that weight's shape, the rank is
    the configured one. CheckpointError / ConfigError naming the file and the tensor otherwise."""
    lora_scale = _checked_scale(lora_scale)
    kind, weights, config_path = find_adapter(path)
    shapes = {entry.name: tuple(entry.shape) for entry in read_header(weights)}
    if not shapes:
        raise CheckpointError(f"{weights}: holds no tensors")
    if kind == "peft":
        config = read_object(config_path, ConfigError)
        scales, module_of = _peft_scales(config, config_path, shapes, weights, args)
    else:
        config = read_object(config_path, ConfigError) if config_path is not None else {}
        scales, module_of = _mistral_scales(config, config_path, shapes, weights)
    adapter = Adapter(weights, kind)
    pairs: Dict[str, Dict[str, str]] = {}
    for name in shapes:
        base = _BASE_NAME.match(name) if kind == "peft" else None
        if base is not None:  # lm_head / embed_tokens saved whole by PEFT (a resized vocabulary): it replaces the base's
            published = module_of(base[1])
            expected = published_shape(published, args) if published in ("output.weight", "tok_embeddings.weight") else None
            if expected is None or tuple(shapes[name]) != expected:
                raise CheckpointError(f"{weights}: tensor {name} {shapes[name]} does not fit the model's "
                                      f"{published or 'weights'} {expected}")  # fmt: skip
            adapter.replaced[published] = name
            continue
        match = _LORA_NAME.match(name)
        if match is None:
            raise CheckpointError(f"{weights}: unexpected tensor {name} (expected MODULE.lora_A.weight and MODULE.lora_B.weight)")
        pairs.setdefault(match[1], {})[match[2]] = name
    for module, pair in pairs.items():
        if len(pair) != 2:
            missing = f"{module}.lora_{'B' if 'A' in pair else 'A'}.weight"
            raise CheckpointError(f"{weights}: missing tensor {missing} (beside {next(iter(pair.values()))})")
        published = module_of(module)
        expected = published_shape(published, args) if published is not None else None
        if expected is None or len(expected) != 2 or published in ("tok_embeddings.weight",) or published.endswith("gate.weight"):
            raise CheckpointError(f"{weights}: unexpected tensor {pair['A']}: this model has no such projection")
        (out, inner), a, b = expected, shapes[pair["A"]], shapes[pair["B"]]
        rank, scale = scales(module, a)
        if len(a) != 2 or len(b) != 2 or a[1] != inner or b[0] != out:
            raise CheckpointError(f"{weights}: tensors {pair['A']} {a} and {pair['B']} {b} do not fit the model's "
                                  f"{published} ({out}, {inner}): an adapter for another base model?")  # fmt: skip
        if a[0] != b[1] or a[0] != rank:
            raise CheckpointError(f"{weights}: tensor {pair['A']} has rank {a[0]} and {pair['B']} rank {b[1]}, "
                                  f"the adapter's configuration says r={rank}")  # fmt: skip
        heads = 0
        if kind == "peft" and published.endswith("attention.wq.weight"):
            heads = args.n_heads
        elif kind == "peft" and published.endswith("attention.wk.weight"):
            heads = args.n_kv_heads
        adapter.updates[published] = Update(pair["A"], pair["B"], scale * lora_scale, heads)
    return adapter


def _peft_scales(config: dict, source: Path, shapes: Dict[str, Tuple[int, ...]], weights: Path, args: ModelArgs):
    """PEFT's per-module (rank, scale) and module name -> published weight name."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{source}: peft_type={config.get('peft_type')!r}: only LoRA adapters are read")
    for key, what in _REFUSED_PEFT.items():
        if config.get(key) not in (None, False, [], {}):
            raise ConfigError(f"{source}: {key}={config[key]!r}: {what} are not read here")
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    for key, value in (("r", r), ("lora_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
            raise ConfigError(f"{source}: {key}={value!r:.40} must be a positive number")
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    for key, pattern in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        if not isinstance(pattern, dict):
            raise ConfigError(f"{source}: {key}={pattern!r:.60} must be an object of module pattern -> number")
        for name, value in pattern.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                raise ConfigError(f"{source}: {key}[{name!r:.60}]={value!r:.40} must be a positive number")
            _compiled(name, f"{source}: {key}[{name!r:.60}]")
    rslora = config.get("use_rslora") is True
    _check_targets(config.get("target_modules"), source, args)

    def scales(module: str, a_shape: Tuple[int, ...]) -> Tuple[int, float]:
        key = module[len(PEFT_PREFIX):] if module.startswith(PEFT_PREFIX) else module
        rank = _pattern_value(rank_pattern, key, r)
        lora_alpha = _pattern_value(alpha_pattern, key, alpha)
        return rank, lora_alpha / (math.sqrt(rank) if rslora else rank)

    def module_of(module: str) -> Optional[str]:
        if not module.startswith(PEFT_PREFIX):
            return None
        return hf_name_to_published(module[len(PEFT_PREFIX):] + ".weight")

    return scales, module_of


def _compiled(pattern: str, what: str) -> "re.Pattern":
    try:
        return re.compile(pattern)
    except re.error as error:
        raise ConfigError(f"{what}: {pattern!r:.60} is not a regular expression ({error})") from None


def _pattern_value(patterns: dict, key: str, default: object) -> object:
    """PEFT's ``get_pattern_key``: the value of the first pattern that is the module's name or ends it."""
    for pattern, value in patterns.items():
        if pattern == key or re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _model_modules(args: ModelArgs) -> List[str]:
    """transformers' names of the model's linear modules (Mixtral's experts as transformers 4.x names them)."""
    names = ["lm_head"]
    for i in range(args.n_layers):
        names += [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkvo"]
        if args.moe is None:
            names += [f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up", "down")]
        else:
            names += [f"model.layers.{i}.block_sparse_moe.experts.{j}.w{k}" for j in range(args.moe.num_experts) for k in (1, 2, 3)]
    return names


def _check_targets(targets: object, source: Path, args: ModelArgs) -> None:
    """ConfigError when ``target_modules`` names nothing in this model (an adapter for another architecture)."""
    if targets is None or targets == "all-linear":
        return
    modules = _model_modules(args)
    if isinstance(targets, str):
        pattern = _compiled(targets, f"{source}: target_modules")
        if not any(pattern.fullmatch(name) for name in modules):
            raise ConfigError(f"{source}: target_modules={targets!r} matches no module of this model")
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"{source}: target_modules={targets!r} must be a list of module names or a pattern")
    unknown = [t for t in targets if not any(name == t or name.endswith("." + t) for name in modules)]
    if unknown and len(unknown) == len(targets):
        raise ConfigError(f"{source}: target_modules {unknown} name no module of this model")


def _mistral_scales(config: dict, source: Optional[Path], shapes: Dict[str, Tuple[int, ...]], weights: Path):
    """mistral-inference's scale (params.json's ``lora.scaling``, else 2.0) and rank (``lora.rank``, else A's)."""
    lora = config.get("lora") or {}
    if not isinstance(lora, dict):
        raise ConfigError(f"{source}: lora={lora!r} must be an object {{\"rank\": ..., \"scaling\": ...}}")
    scaling, rank = lora.get("scaling", MISTRAL_DEFAULT_SCALING), lora.get("rank")
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling):
        raise ConfigError(f"{source}: lora.scaling={scaling!r} must be a number")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ConfigError(f"{source}: lora.rank={rank!r} must be a positive integer")

    def scales(module: str, a_shape: Tuple[int, ...]) -> Tuple[int, float]:
        return (rank if rank is not None else (a_shape[0] if a_shape else 0)), float(scaling)

    return scales, lambda module: module + ".weight"


def merged(tensors: NamedTensors, adapter: Adapter, dtype: Optional[torch.dtype] = None,
           select: Optional[Selector] = None) -> NamedTensors:  # fmt: skip
    """Published (name, tensor) pairs with the adapter's updates added, each as its weight passes:
    ``W + scale * (B @ A)`` in float32, then in the more precise of the weight's dtype and ``dtype`` (the
    dtype the model is loaded in), so a bfloat16 file loaded in float32 keeps the update's precision.
    ``select``: the loader's selection (a rank's share), applied to the update as it was to the weight."""
    factors = adapter.factors()
    replaced = {}
    if adapter.replaced:  # the adapter's own copies of whole weights (small models' lm_head, at most two)
        wanted = {copy: name for name, copy in adapter.replaced.items()}
        replaced = {wanted[copy]: t for copy, t in iter_tensors(adapter.path, lambda n: Selection() if n in wanted else None)}
    for name, tensor in tensors:
        if name in replaced:
            copy = replaced.pop(name)
            copy = apply_selection(copy, select(name)) if select is not None else copy
            tensor = copy.to(tensor.dtype if dtype is None else torch.promote_types(copy.dtype, dtype))
        if name in factors:
            b, a, scale = factors.pop(name)
            delta = (b.float() @ a.float()) * scale  # [out, in]
            if select is not None:
                delta = apply_selection(delta, select(name))
            if tuple(delta.shape) != tuple(tensor.shape):
                raise CheckpointError(f"{adapter.path}: the update of {name} is {tuple(delta.shape)}, the weight {tuple(tensor.shape)}")
            out = tensor.dtype if dtype is None else torch.promote_types(tensor.dtype, dtype)
            tensor = (tensor.float() + delta.to(tensor.device)).to(out)
        yield name, tensor


# Projections an adapter kept apart may update: attention's and a dense feed-forward's (formats.adapters).
_SERVED_TARGET = re.compile(r"^layers\.\d+\.(attention\.w[qkvo]|feed_forward\.w[123])\.weight$")


def parse_named_adapters(spec: object) -> List[Tuple[str, str]]:
    """``"NAME=PATH,NAME=PATH"`` (``serve --lora``) as (name, path) pairs; ConfigError for a missing name or
    path, or a name given twice. ``parse_named_adapters("sql=/a, chat=/b") == [("sql", "/a"), ("chat", "/b")]``."""
    pairs: List[Tuple[str, str]] = []
    items = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    for item in items:
        name, sep, path = str(item).strip().partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ConfigError(f"--lora {item!r}: give NAME=PATH (several: NAME=PATH,NAME=PATH)")
        if any(name == known for known, _ in pairs):
            raise ConfigError(f"--lora: the adapter name {name!r} is given twice")
        pairs.append((name, path))
    return pairs


def open_served(path: str | Path, args: ModelArgs, lora_scale: float = 1.0) -> Adapter:
    """``open_adapter``, and the checks of an adapter kept apart (served beside others, ``formats.adapters``):
    its targets are attention's and a dense feed-forward's projections (a merged adapter may target more)."""
    adapter = open_adapter(path, args, lora_scale)
    if adapter.replaced:
        raise CheckpointError(f"{adapter.path}: replaces whole weights ({', '.join(sorted(adapter.replaced))}): "
                              "load it merged (--lora PATH without a name)")  # fmt: skip
    for name, update in adapter.updates.items():
        if not _SERVED_TARGET.match(name):
            raise CheckpointError(f"{adapter.path}: tensor {update.a_name} updates {name}; adapters served apart update "
                                  "attention's and a dense feed-forward's projections only: load it merged (--lora PATH)")  # fmt: skip
    return adapter


def attach_served(model: nn.Module, named: Sequence[Tuple[str, str | Path]], lora_scale: float = 1.0) -> List[str]:
    """Keep each adapter of ``named`` ((name, path) pairs) apart beside ``model``'s weights
    (``formats.adapters.attach_adapters``): every one checked first, then read. Request i + 1 of the
    engine runs ``named[i]``. The names."""
    adapters = [open_served(path, model.args, lora_scale) for _, path in named]
    attach_adapters(model, [name for name, _ in named], [adapter.factors() for adapter in adapters])
    return [name for name, _ in named]
