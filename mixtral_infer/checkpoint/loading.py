"""Reading model folders: the published consolidated format and Hugging Face's.

A **Mistral folder** holds ``params.json``, ``consolidated.safetensors`` (or
``consolidated.00.pth``) and ``tokenizer.model``. A **Hugging Face folder** holds
``config.json`` (``MistralForCausalLM`` / ``MixtralForCausalLM`` / ``MinistralForCausalLM``), ``model.safetensors``
or shards listed in ``model.safetensors.index.json``, and ``tokenizer.model``.
The format is detected from the files.

Both are read as a stream of tensors under their *published* names
(``hf_format`` translates), and each tensor goes straight to its final dtype and
device in a model built on the meta device, so loading holds about one copy of
the model. This package's modules differ from the published names only in that
a MoE layer's experts are stacked: published
``layers.{i}.feed_forward.experts.{j}.w1.weight`` (I, D), j = 0..E-1, becomes
``layers.{i}.feed_forward.w1`` (E, I, D).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from mixtral_infer.checkpoint import bnb_4bit
from mixtral_infer.checkpoint.compute_dtype import compute_dtype, stored_dtype
from mixtral_infer.checkpoint.gguf_file import GgufFile, GgufLoading, is_gguf
from mixtral_infer.checkpoint.lora import merged, open_adapter
from mixtral_infer.checkpoint.params import args_from_params, args_to_params, checked_args
from mixtral_infer.checkpoint.hf_format import (
    args_from_hf_config,
    check_hf_shape,
    hf_name_to_published,
    hf_to_published,
    is_rotary_buffer,
)
from mixtral_infer.checkpoint.quantized import (
    check_recorded_scheme,
    check_stored_shape,
    from_stored,
    quantize_published,
    scheme_from_params,
    stack,
    stored_select,
)
from mixtral_infer.checkpoint.safetensors_reader import (
    Selector,
    ShapeCheck,
    apply_selection,
    iter_tensors,
    read_header,
    read_metadata,
)
from mixtral_infer.checkpoint.weight_shapes import check_published_shape
from mixtral_infer.devices import checked_device, checked_dtype, default_device
from mixtral_infer.errors import CheckpointError, ConfigError, as_int
from mixtral_infer.formats.modules import prepare_and_swap
from mixtral_infer.formats.measured import machine_tuning
from mixtral_infer.hardware import cpu_info
from mixtral_infer.json_file import read_object
from mixtral_infer.checkpoint.shares import Selection, select_share
from mixtral_infer.model.parallel import Parallel
from mixtral_infer.model.transformer import ModelArgs, Transformer
from mixtral_infer.quant.model import check_quantizable, is_quantized_published
from mixtral_infer.formats.quantizing import install
from mixtral_infer.quant.weights import QuantizedWeight, QuantScheme
from mixtral_infer.shipped import resolve_model_folder
from mixtral_infer.tokenizer import find_tokenizer
from mixtral_infer.tuning import Tuning

PARAMS_FILE = "params.json"
SAFETENSORS_FILE = "consolidated.safetensors"
PTH_FILE = "consolidated.00.pth"
TOKENIZER_FILE = "tokenizer.model"
HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
HF_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "MinistralForCausalLM")

Progress = Callable[[int, int], None]  # (tensors read, tensors in all)
NamedTensors = Iterator[Tuple[str, torch.Tensor]]

_EXPERT_NAME = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(w[123])\.weight$")
_STACKED_NAME = re.compile(r"^layers\.(\d+)\.feed_forward\.(w[123])$")


def default_dtype(checkpoint: "Checkpoint", device: torch.device, quantize: Optional[QuantScheme] = None) -> torch.dtype:
    """What ``load_model`` computes in without ``dtype=``: bfloat16 for quantized weights (the CPU
    kernels' dtype; a GGUF file's Q4_0 blocks kept as int4 too), else the checkpoint's own dtype where
    ``device`` can compute in it (``compute_dtype``).
    w8a8's product takes any float dtype: bfloat16 where ``device`` computes in it, else float32."""
    scheme = quantize or checkpoint.quantization or checkpoint.bitsandbytes
    if scheme is None and checkpoint.gguf is not None:
        scheme = checkpoint.gguf.kept_scheme()  # Q4_0 blocks kept as int4 weights
    if scheme is not None and scheme.activations and device.type == "cpu" and torch.bfloat16 not in cpu_info().native:
        return torch.float32
    if scheme is not None:
        return torch.bfloat16
    return compute_dtype(checkpoint.stored_dtype(), device)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    return read_object(path, ConfigError)


def read_params(folder: str | Path) -> ModelArgs:
    return _read_params(folder)[0]


def _read_params(folder: str | Path) -> Tuple[ModelArgs, Optional[QuantScheme]]:
    """The model's arguments and, for a folder written by ``convert --quantize``, its quantization."""
    path = Path(folder) / PARAMS_FILE
    params = _read_json(path)
    stored = scheme_from_params(params, str(path))
    return args_from_params(params, source=str(path)), stored


# ---------------------------------------------------------------- reading tensors


def _open_pth(path: Path) -> Dict[str, torch.Tensor]:
    """The state dict of a ``.pth`` file, memory-mapped: no tensor data is read yet."""
    try:
        state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:
        message = _one_line(error)
        if "weights_only" in str(error) or "Unsupported global" in str(error):
            message = "it holds pickled objects other than tensors, which could run code; refused (weights-only loading)"
        raise CheckpointError(f"{path}: cannot read weights: {message}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a dict of tensor name -> tensor")
    bad = [key for key in state if not isinstance(key, str)]
    if bad:
        raise CheckpointError(f"{path}: tensor name {bad[0]!r} is a {type(bad[0]).__name__}, expected a string")
    return state


def _pth_tensors(path: Path, select: Optional[Selector] = None, check: Optional[ShapeCheck] = None) -> NamedTensors:
    state = _open_pth(path)
    if check is not None:
        for name, tensor in state.items():  # memory-mapped: nothing is read yet
            check(name, tuple(tensor.shape))
    yield from _selected(state.items(), select)


def _selected(tensors: Iterable[Tuple[str, torch.Tensor]], select: Optional[Selector]) -> NamedTensors:
    """The part of each tensor that ``select(name)`` keeps; tensors it gives None for are left out."""
    for name, tensor in tensors:
        selection = select(name) if select is not None else Selection()
        if selection is not None:
            yield name, apply_selection(tensor, selection)


def _tensor_count(path: Path) -> int:
    return len(read_header(path)) if path.suffix == ".safetensors" else len(_open_pth(path))


@dataclass
class Checkpoint:
    """A model folder, opened: its arguments and where its tensors are. Nothing is read yet."""

    folder: Path
    format: str  # "mistral" or "hf"
    args: ModelArgs
    weight_files: List[Path]
    quantization: Optional[QuantScheme] = None  # how the stored weights are quantized (convert --quantize)
    bitsandbytes: Optional[QuantScheme] = None  # nf4: a Hugging Face folder of bitsandbytes' 4-bit weights (bnb_4bit)
    tied_output: bool = False  # config.json's tie_word_embeddings: without lm_head.weight, the output is the embeddings
    gguf: Optional[GgufFile] = None  # format "gguf": llama.cpp's file (folder and weight_files[0] are its path)

    def stored_dtype(self) -> Optional[torch.dtype]:
        """The floating dtype holding most of the weights, from the file headers (nothing is read)."""
        if self.gguf is not None:
            return self.gguf.stored_dtype()

        def dtypes_and_sizes(path: Path) -> Iterator[Tuple[torch.dtype, int]]:
            if path.suffix == ".safetensors":
                return ((entry.dtype, math.prod(entry.shape)) for entry in read_header(path))
            return ((tensor.dtype, tensor.numel()) for tensor in _open_pth(path).values())

        return stored_dtype(pair for path in self.weight_files for pair in dtypes_and_sizes(path))

    def published_tensors(self, progress: Optional[Progress] = None, select: Optional[Selector] = None) -> NamedTensors:
        """Every tensor under its published name, one at a time.

        ``select(published_name)`` keeps part of a tensor or skips it; in the Mistral
        layout skipped tensors are not even read.
        """
        if self.format == "mistral":
            yield from self._raw_tensors(progress, select)
            return
        if self.gguf is not None:
            yield from self.gguf.published_tensors(progress, select)
            return
        raw = self._raw_tensors(progress, _hf_file_select(select))
        if self.bitsandbytes is not None:  # each weight's packed codes and quant state as one nf4 weight
            raw = bnb_4bit.gathered(raw, str(self.folder))
        embeddings, has_output = None, False
        for name, tensor in raw:
            if self.tied_output and name == "model.embed_tokens.weight":
                embeddings = tensor
            has_output = has_output or name == "lm_head.weight"
            yield from _selected(hf_to_published([(name, tensor)], self.args), select)
        if self.tied_output and not has_output and embeddings is not None:  # as transformers ties them
            yield from _selected(hf_to_published([("lm_head.weight", embeddings.clone())], self.args), select)

    def _raw_tensors(self, progress: Optional[Progress], select: Optional[Selector]) -> NamedTensors:
        """Every file's tensors under the file's own names, each shape checked before a file is read."""
        total = sum(_tensor_count(p) for p in self.weight_files) if progress is not None else 0
        done = 0
        check_shape = check_published_shape if self.format == "mistral" else check_hf_shape
        if self.quantization is not None:
            check_shape = lambda name, shape, args, source: check_stored_shape(name, shape, args, self.quantization, source)  # noqa: E731
        if self.bitsandbytes is not None:
            check_shape = bnb_4bit.check_bnb_shape
        for path in self.weight_files:
            check = lambda name, shape, path=path: check_shape(name, shape, self.args, str(path))  # noqa: E731
            read = iter_tensors if path.suffix == ".safetensors" else _pth_tensors
            for name, tensor in read(path, select, check):
                done += 1
                if progress is not None:
                    progress(done, total)
                yield name, tensor


def _hf_file_select(select: Optional[Selector]) -> Optional[Selector]:
    """For a transformers file: skip the tensors whose published counterpart ``select`` leaves out (another
    pipeline stage's layers, another rank's experts); read the others whole, to be cut after translation
    (their q/k rows are permuted per head, their experts may be fused), and never older transformers'
    rotary buffers (``hf_format.is_rotary_buffer``)."""

    def pick(name: str) -> Optional[Selection]:
        if is_rotary_buffer(name):  # older transformers' inv_freq buffers: never read
            return None
        published = hf_name_to_published(name)
        return None if select is not None and published is not None and select(published) is None else Selection()

    return pick


def _hf_weight_files(folder: Path) -> List[Path]:
    index = folder / HF_INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = [_shard_path(folder, index, tensor, name) for tensor, name in weight_map.items()]
        for path in dict.fromkeys(files):
            if not path.is_file():
                raise CheckpointError(f"{path}: file not found (listed in {HF_INDEX_FILE})")
        return list(dict.fromkeys(files))
    if (folder / HF_WEIGHTS_FILE).is_file():
        return [folder / HF_WEIGHTS_FILE]
    raise CheckpointError(f"{folder}: no weights found (expected {HF_WEIGHTS_FILE} or {HF_INDEX_FILE})")


def _shard_path(folder: Path, index: Path, tensor: str, name: object) -> Path:
    """The shard file an index entry names: a relative path that stays inside the model folder.

    Only the name is judged: a shard that is a symlink (as in the Hugging Face hub's
    cache, where it points into ``../../blobs``) is followed like any file of the folder.
    """
    if not isinstance(name, str) or not name.endswith(".safetensors"):
        raise CheckpointError(f"{index}: weight_map[{tensor!r}]={name!r} must name a .safetensors file")
    normal = os.path.normpath(name)
    if os.path.isabs(normal) or normal == ".." or normal.startswith(".." + os.sep) or "\0" in name:
        raise CheckpointError(f"{index}: weight_map[{tensor!r}]={name!r} points outside the model folder")
    return folder / normal


MAX_LENGTH_KEYS = ("max_seq_len", "max_position_embeddings")  # a params.json's or config.json's longest sequence


def declared_max_len(checkpoint: Checkpoint) -> Optional[int]:
    """The longest sequence the folder's configuration declares (params.json's ``max_seq_len`` or
    ``max_position_embeddings``, config.json's ``max_position_embeddings``), None where it declares none."""
    if checkpoint.gguf is not None:
        value = as_int(checkpoint.gguf.context_length())
        return value if value is not None and value >= 1 else None
    path = checkpoint.folder / (PARAMS_FILE if checkpoint.format == "mistral" else HF_CONFIG_FILE)
    config = _read_json(path)
    for key in MAX_LENGTH_KEYS:
        value = as_int(config.get(key))
        if value is not None and value >= 1:
            return value
    return None


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """Detect the folder's format and read its configuration; raise CheckpointError if it is neither.

    ``folder`` may also be a shipped model's name (``tiny-mixtral``, ``tiny-mistral``).
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise CheckpointError(f"folder={folder!r}: give a model folder's path or a shipped model's name (see `models`)")
    folder = resolve_model_folder(folder)
    if not folder.exists():
        raise CheckpointError(f"{folder}: model folder not found")
    if is_gguf(folder):  # llama.cpp's single file (checkpoint/gguf_file.py)
        gguf = GgufFile(folder)
        return Checkpoint(folder, "gguf", gguf.args, [folder], tied_output=gguf.tied_output, gguf=gguf)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: is not a folder (give the folder holding params.json or config.json)")
    if (folder / PARAMS_FILE).is_file():
        args, stored = _read_params(folder)
        if (folder / SAFETENSORS_FILE).is_file():  # its recorded quantization, if any, is params.json's
            path = folder / SAFETENSORS_FILE
            check_recorded_scheme(read_metadata(path), stored, str(path), str(folder / PARAMS_FILE))
        for name in (SAFETENSORS_FILE, PTH_FILE):
            if (folder / name).is_file():
                return Checkpoint(folder, "mistral", args, [folder / name], stored)
        raise CheckpointError(f"{folder}: no weights found (expected {SAFETENSORS_FILE} or {PTH_FILE})")
    if (folder / HF_CONFIG_FILE).is_file():
        config_path = folder / HF_CONFIG_FILE
        config = _read_json(config_path)
        architectures = config.get("architectures") or []
        if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
            raise ConfigError(f"{config_path}: architectures={architectures!r} must be a list of names, e.g. {list(HF_ARCHITECTURES[:1])}")
        if not set(architectures) & set(HF_ARCHITECTURES):
            raise CheckpointError(f"{config_path}: architectures={architectures}, expected one of {list(HF_ARCHITECTURES)}")
        args = args_from_hf_config(config, str(config_path))
        bitsandbytes = bnb_4bit.scheme_from_config(config, str(config_path))
        tied = config.get("tie_word_embeddings") is True
        return Checkpoint(folder, "hf", args, _hf_weight_files(folder), bitsandbytes=bitsandbytes, tied_output=tied)
    raise CheckpointError(f"{folder}: neither {PARAMS_FILE} (Mistral format) nor {HF_CONFIG_FILE} (Hugging Face format) found")


# ---------------------------------------------------------------- filling a model


def _stack_experts(tensors: NamedTensors, args: ModelArgs, parallel: Parallel = Parallel(), source: str = "") -> NamedTensors:
    """Published pairs -> internal pairs: each layer's experts stacked once the last one arrives.

    With expert parallelism only this rank's experts arrive and are stacked.
    """
    n_experts = args.moe.num_experts if args.moe is not None else 0
    local = parallel.share(n_experts)
    pending: Dict[Tuple[int, str], Dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        match = _EXPERT_NAME.match(name)
        if match is None:
            yield name, tensor
            continue
        layer, expert, weight = int(match[1]), int(match[2]), match[3]
        if expert >= n_experts:
            raise CheckpointError(f"{source}: unexpected tensor {name}: params say {n_experts} experts")
        group = pending.setdefault((layer, weight), {})
        group[expert] = tensor
        if len(group) == len(local):
            del pending[(layer, weight)]
            yield f"layers.{layer}.feed_forward.{weight}", stack([group[j] for j in local])
    for (layer, weight), group in pending.items():
        missing = [f"layers.{layer}.feed_forward.experts.{e}.{weight}.weight" for e in sorted(set(local) - set(group))]
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}{more}")


def _assign(model: Transformer, name: str, tensor: torch.Tensor | QuantizedWeight, source: str) -> None:
    module_path, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_path) if module_path else model
        current = module._parameters[leaf]
    except (AttributeError, KeyError):
        raise CheckpointError(f"{source}: unexpected tensor {name}") from None
    if current is None or tuple(current.shape) != tuple(tensor.shape):
        expected = None if current is None else tuple(current.shape)
        raise CheckpointError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, the model config implies {expected}")
    if isinstance(tensor, QuantizedWeight):
        install(model, name, tensor)
    else:
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def build_model(
    args: ModelArgs,
    tensors: NamedTensors,
    source: Path | str,
    device: Optional[torch.device | str] = None,
    dtype: Optional[torch.dtype] = None,
    parallel: Parallel = Parallel(),
    quantize: Optional[QuantScheme] = None,
    stored: Optional[QuantScheme] = None,
    tuning: Tuning = Tuning(),
) -> Transformer:
    """A model on ``device`` in ``dtype`` (default float32, bfloat16 on CUDA) from published (name, tensor) pairs.

    Built on the meta device; each tensor is moved to its final dtype and device as
    it is read, so the peak is about one model plus one layer's experts.
    ``quantize``: quantize the weights (``quant.model``) as they are read, each expert on
    its own, so the peak is the quantized model plus one float tensor and one layer's
    quantized experts. ``stored``: the tensors are a quantized folder's (``convert --quantize``).
    ``tuning``: quantized weights in the layouts of the back-ends that read them under it
    (``kernels.linear.prepare_weight``; ``Tuning(fast=False)``: the plain layout the reference reads).
    The model's modules are the reference's (``formats.modules.prepare_and_swap`` swaps).
    """
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    with torch.device("meta"):
        model = Transformer(args, parallel)
    if quantize is not None and stored is not None:
        raise ConfigError(f"{source}: the weights are stored quantized as {stored.label} already; "
                          "load without quantize= (--quantize)")  # fmt: skip
    if quantize is not None:
        tensors = quantize_published(tensors, quantize, dtype, device, tuning)
    elif stored is not None:
        tensors = from_stored(tensors, stored, dtype, device, str(source), tuning)
    seen = set()
    for name, tensor in _stack_experts(tensors, args, parallel, str(source)):
        if name in seen:
            raise CheckpointError(f"{source}: tensor {name} appears twice")
        seen.add(name)
        if isinstance(tensor, QuantizedWeight):
            _assign(model, name, tensor, str(source))
            continue
        if not tensor.is_floating_point():
            raise CheckpointError(f"{source}: tensor {name} has dtype {tensor.dtype}, expected floating point")
        placed = tensor.to(device=device, dtype=dtype)
        check_finite(name, tensor, placed, str(source))
        _assign(model, name, placed, str(source))
    missing = [name for name, param in model.named_parameters() if param.is_meta]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}{more}")
    return model.eval()


def check_finite(name: str, stored: torch.Tensor, placed: torch.Tensor, source: str,
                 remedy: str = "load in bfloat16 or float32") -> None:  # fmt: skip
    """CheckpointError when a weight holds NaN or inf as loaded: stored so (a damaged checkpoint), or
    past ``placed``'s range (float16's 65504). A NaN weight does not always reach the logits' check:
    bfloat16 attention on CPU drops a NaN key's scores, decoding garbage that looks fine. Checked by
    the smallest and largest value (``aminmax`` carries NaN through): one reduction at the speed of
    reading, where ``isfinite(...).all()`` writes a mask first (docs/performance.md, section 13)."""
    if placed.numel() == 0 or bool(torch.isfinite(torch.stack(torch.aminmax(placed))).all()):
        return
    if placed.dtype != stored.dtype and bool(torch.isfinite(stored).all()):
        raise CheckpointError(
            f"{source}: {name} holds values beyond {placed.dtype}'s range: {remedy}"
        )
    raise CheckpointError(f"{source}: {name} holds NaN or infinite values: the checkpoint is damaged")


def check_tokenizer_vocab(tokenizer_path: Path, args: ModelArgs) -> None:
    from mixtral_infer.tokenizer import Tokenizer

    n_words = Tokenizer(tokenizer_path).n_words
    if n_words != args.vocab_size:
        raise CheckpointError(
            f"{tokenizer_path}: vocabulary of {n_words} tokens, but the model config says vocab_size={args.vocab_size}"
        )


def load_model(
    folder: str | Path,
    max_batch_size: int = 1,
    device: Optional[torch.device | str] = None,
    dtype: Optional[torch.dtype] = None,
    progress: Optional[Progress] = None,
    parallel: Parallel = Parallel(),
    quantize: Optional[str | QuantScheme] = None,
    pack: bool | str = True,
    fast: Optional[bool] = None,
    tuning: Optional[Tuning] = None,
    lora: Optional[str | Path] = None,
    lora_scale: float = 1.0,
) -> Transformer:
    """Load a Mistral or Hugging Face model folder (format detected from its files).

    ``fast``: swap in the fast modules and kernels (``formats.modules``); False keeps the readable
    reference everywhere (no packed layouts, quantized weights dequantized for each product), for
    reading, debugging and as the oracle in tests. None: fast unless ``MIXTRAL_INFER_REFERENCE=1``.
    ``tuning``: what the fast paths do (``Tuning``, its ``fast`` in place of ``fast``); by default
    this machine's, measured once and kept on disk (``formats.measured.machine_tuning``).

    ``dtype``: what the model computes in; by default the checkpoint's own dtype where the
    device has native arithmetic for it, else float32 (``checkpoint.compute_dtype``).
    With ``parallel``, only this rank's share of the weights is read and kept.
    ``quantize``: ``"int8"``, ``"int4"`` (groups of 32 inputs), ``"int4-128"`` or ``"nf4"`` (4-bit
    NormalFloat, groups of 64; ``quant/nf4.py``): weight-only quantization while loading
    (``quant/``); ``"w8a8"``: int8 weights, and on CPU int8 activations
    too (``kernels/linear/w8a8.py``); without ``dtype`` the model then computes in
    bfloat16, the dtype of the CPU kernels. A folder written by ``convert --quantize``
    loads quantized without it.
    ``pack``: a bfloat16 model on CPU keeps its matrices in oneDNN's layout, which the
    eager loop decodes faster (``kernels.linear.packed_bf16``); ``pack="columns"``, for compiled
    decoding, which reads plain 16-bit weights faster still (``fast.cpu_reductions``), keeps
    them plain but for rows longer than 2048 (at Mistral 7B's widths, every matrix), stored in blocks of columns
    (``fast.cpu_column_blocks``; the CLI's ``--decode compiled`` loads so); ``pack=False`` keeps
    plain ``nn.Parameter``s throughout: to edit weights.
    ``lora``: a LoRA adapter (a PEFT folder, or mistral-inference's ``lora.safetensors``) merged into
    each weight as it is read, before it is quantized or packed (``checkpoint/lora.py``); ``lora_scale``
    multiplies the adapter's own scale. Its names and shapes are checked before any weight is read.
    No process-wide setting changes; the command line and the server keep freed blocks in the
    process for the next prompt (``mixtral_infer.memory.keep_freed_memory``).
    """
    if pack not in (True, False, "columns") or type(pack) is int:  # 1 == True
        raise ConfigError(f"pack={pack!r}: use True (oneDNN's layout), 'columns' (compiled decoding) or False (plain)")
    if not isinstance(parallel, Parallel):
        raise ConfigError(f"parallel={parallel!r:.40} must be a Parallel (mixtral_infer.model.parallel), or left out")
    if progress is not None and not callable(progress):  # it failed while reading
        raise ConfigError(f"progress={progress!r:.40} must be a function progress(done, total), or None")
    if fast not in (None, True, False) or type(fast) is int:
        raise ConfigError(f"fast={fast!r}: use True (the fast modules), False (the reference) or None (by the environment)")
    if tuning is not None and not isinstance(tuning, Tuning):
        raise ConfigError(f"tuning={tuning!r:.40} must be a Tuning (mixtral_infer.tuning), or left out")
    if tuning is not None and fast is not None and fast != tuning.fast:
        raise ConfigError(f"fast={fast!r} and tuning=Tuning(fast={tuning.fast!r}) disagree: pass one of them")
    scheme = QuantScheme.parse(quantize)
    device = checked_device(device, f"device={device!r}")
    dtype = checked_dtype(dtype, f"dtype={dtype!r}")
    checkpoint = open_checkpoint(folder)
    checkpoint.args = checked_args({**vars(checkpoint.args), "max_batch_size": max_batch_size}, "load_model")
    parallel.check(checkpoint.args)
    stored = checkpoint.quantization
    if scheme is not None and stored is not None:
        raise ConfigError(f"{checkpoint.folder}: the weights are stored quantized as {stored.label} already; load without quantize=")
    if checkpoint.bitsandbytes is not None and scheme is not None:
        raise ConfigError(
            f"{checkpoint.folder}: the weights are stored quantized by bitsandbytes (nf4) already; "
            "load without quantize="
        )
    if checkpoint.bitsandbytes is not None and parallel != Parallel():
        raise ConfigError(
            f"{checkpoint.folder}: a bitsandbytes 4-bit folder loads in one process only; "
            "load the float original to split it"
        )
    if scheme is not None or stored is not None:
        check_quantizable(checkpoint.args, scheme or stored, parallel.tensor_parallel)
    adapter = None
    if lora is not None:
        if stored is not None or checkpoint.bitsandbytes is not None:
            raise ConfigError(f"{checkpoint.folder}: its weights are stored quantized; merge a LoRA adapter "
                              "into the float original (quantize= after merging)")  # fmt: skip
        adapter = open_adapter(lora, checkpoint.args, lora_scale)  # every name and shape, before any weight is read
    dtype = dtype or default_dtype(checkpoint, device, scheme)
    tokenizer = find_tokenizer(checkpoint.folder)
    if tokenizer is not None:
        check_tokenizer_vocab(tokenizer, checkpoint.args)  # before any weight is read
    select = None if parallel == Parallel() else lambda name: select_share(parallel, name, checkpoint.args)
    if select is not None and stored is not None:
        select = stored_select(select, stored)  # a quantized folder's integers and scales
    kept = checkpoint.gguf.kept_scheme(scheme) if checkpoint.gguf is not None else None  # Q4_0 blocks kept as int4
    integers = any(s is not None and s.name in ("int8", "int4") for s in (scheme, stored, kept)) and device.type == "cpu"
    floats = dtype == torch.float32 and device.type == "cpu"
    bfloat16 = dtype == torch.bfloat16 and device.type == "cpu" and not any((scheme, stored, kept))
    tuning = tuning if tuning is not None else machine_tuning(fast, integers=integers, floats=floats, bfloat16=bfloat16)  # measured once per machine, before any weight is read
    if checkpoint.gguf is not None:  # its Q4_0 blocks kept as int4 weights, placed as they are read (checkpoint/gguf_file.py)
        placing = GgufLoading(dtype, device, tuning, scheme, keep_blocks=adapter is None)
        tensors = checkpoint.gguf.published_tensors(progress, select, placing)
    else:
        tensors = checkpoint.published_tensors(progress, select)
    if adapter is not None:
        tensors = merged(tensors, adapter, dtype, select)
    if checkpoint.bitsandbytes is not None:
        tensors = bnb_4bit.placed(tensors, is_quantized_published, dtype, device, tuning)
    model = build_model(checkpoint.args, tensors, checkpoint.weight_files[0].parent, device, dtype, parallel, scheme, stored,
                        tuning)  # fmt: skip
    return prepare_and_swap(model, tuning, pack)  # the back-ends' layouts for weights that go together, then their modules


# ---------------------------------------------------------------- writing


def internal_to_published(state: Dict[str, torch.Tensor], args: ModelArgs) -> NamedTensors:
    """This package's (name, tensor) pairs under published names: one tensor per expert again."""
    for name, tensor in state.items():
        match = _STACKED_NAME.match(name)
        if match and args.moe is not None:
            for j in range(args.moe.num_experts):
                yield f"layers.{match[1]}.feed_forward.experts.{j}.{match[2]}.weight", tensor[j]
        else:
            yield name, tensor


def save_model(model: Transformer, folder: str | Path, tokenizer=None) -> None:
    """Write ``model`` as a Mistral folder that ``load_model`` (and ``convert --to hf``) reads:
    params.json and consolidated.safetensors, and the tokenizer's file when ``tokenizer`` is given.

    >>> save_model(model, "my-model", tokenizer)                        # doctest: +SKIP
    >>> load_model("my-model")                                          # doctest: +SKIP
    """
    import shutil

    save_consolidated(model, folder)
    if tokenizer is not None:
        shutil.copy(tokenizer.path, Path(folder) / Path(tokenizer.path).name)


def save_consolidated(model: Transformer, folder: str | Path) -> None:
    """Write params.json and consolidated.safetensors with the published names, of a float model (a
    quantized one is written by ``convert --quantize`` from its float original)."""
    from mixtral_infer.checkpoint.safetensors_writer import write_safetensors

    if any(isinstance(weight, QuantizedWeight) for weight in model.modules()):
        raise ConfigError("save_consolidated writes float models: write a quantized folder with convert --quantize")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PARAMS_FILE).write_text(json.dumps(args_to_params(model.args), indent=2) + "\n", encoding="utf-8")
    write_safetensors(folder / SAFETENSORS_FILE, internal_to_published(model.state_dict(), model.args))
