"""Reading and writing model folders in the published consolidated format.

A model folder holds ``params.json``, ``consolidated.safetensors`` (or
``consolidated.00.pth``) and usually ``tokenizer.model``. Weight names are the
published ones; the only difference from this package's modules is that the
experts of a MoE layer are stacked: published
``layers.{i}.feed_forward.experts.{j}.w1.weight`` (I, D) for j in 0..E-1 becomes
``layers.{i}.feed_forward.w1`` (E, I, D) here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mixtral_infer.errors import CheckpointError, ConfigError
from mixtral_infer.model import ModelArgs, Transformer

PARAMS_FILE = "params.json"
SAFETENSORS_FILE = "consolidated.safetensors"
PTH_FILE = "consolidated.00.pth"
TOKENIZER_FILE = "tokenizer.model"

Progress = Callable[[int, int], None]  # (tensors read, tensors in all)

_EXPERT_NAME = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(\d+)\.(w[123])\.weight$")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def read_params(folder: str | Path) -> ModelArgs:
    path = Path(folder) / PARAMS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found (a model folder needs params.json)")
    try:
        params = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(params, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(params).__name__}")
    return ModelArgs.from_params(params, source=str(path))


def weights_file(folder: str | Path) -> Path:
    folder = Path(folder)
    for name in (SAFETENSORS_FILE, PTH_FILE):
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(f"{folder}: no weights found (expected {SAFETENSORS_FILE} or {PTH_FILE})")


def iter_published_tensors(path: Path, progress: Optional[Progress] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a weights file, read lazily (safetensors, or a memory-mapped .pth)."""
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                names = list(handle.keys())
                for done, name in enumerate(names, 1):
                    yield name, handle.get_tensor(name)
                    if progress is not None:
                        progress(done, len(names))
        else:
            state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
            if not isinstance(state, dict):
                raise CheckpointError(f"{path}: expected a dict of tensors, got {type(state).__name__}")
            for done, (name, tensor) in enumerate(state.items(), 1):
                yield name, tensor
                if progress is not None:
                    progress(done, len(state))
    except CheckpointError:
        raise
    except Exception as error:  # safetensors and pickle raise many types for a corrupt file
        raise CheckpointError(f"{path}: cannot read weights ({type(error).__name__}: {error})") from None


def published_to_internal(tensors: Iterator[Tuple[str, torch.Tensor]], args: ModelArgs) -> Dict[str, torch.Tensor]:
    """Map published names to this package's, stacking each MoE layer's experts."""
    state: Dict[str, torch.Tensor] = {}
    experts: Dict[Tuple[int, str], Dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        match = _EXPERT_NAME.match(name)
        if match:
            layer, expert, weight = int(match[1]), int(match[2]), match[3]
            experts.setdefault((layer, weight), {})[expert] = tensor
        else:
            state[name] = tensor
    n_experts = args.moe.num_experts if args.moe is not None else 0
    for (layer, weight), by_index in experts.items():
        if sorted(by_index) != list(range(n_experts)):
            raise CheckpointError(
                f"layer {layer} {weight}: found experts {sorted(by_index)}, params.json says {n_experts} experts"
            )
        state[f"layers.{layer}.feed_forward.{weight}"] = torch.stack([by_index[j] for j in range(n_experts)])
    return state


def internal_to_published(state: Dict[str, torch.Tensor], args: ModelArgs) -> Dict[str, torch.Tensor]:
    """The inverse of ``published_to_internal``: one tensor per expert again."""
    published: Dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = re.match(r"^layers\.(\d+)\.feed_forward\.(w[123])$", name)
        if match and args.moe is not None:
            for j in range(args.moe.num_experts):
                published[f"layers.{match[1]}.feed_forward.experts.{j}.{match[2]}.weight"] = tensor[j].clone()
        else:
            published[name] = tensor
    return published


def check_state(model: Transformer, state: Dict[str, torch.Tensor], source: Path) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)}, params.json implies {tuple(expected[name].shape)}"
            )


def load_model(
    folder: str | Path,
    max_batch_size: int = 1,
    device: Optional[torch.device | str] = None,
    dtype: Optional[torch.dtype] = None,
    progress: Optional[Progress] = None,
) -> Transformer:
    """Build the model on the meta device and fill it tensor by tensor from the weights file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: model folder not found")
    args = read_params(folder)
    args.max_batch_size = max_batch_size
    path = weights_file(folder)
    return build_model(args, iter_published_tensors(path, progress), path, device=device, dtype=dtype)


def build_model(
    args: ModelArgs,
    tensors: Iterator[Tuple[str, torch.Tensor]],
    source: Path | str,
    device: Optional[torch.device | str] = None,
    dtype: Optional[torch.dtype] = None,
) -> Transformer:
    """A model on ``device`` in ``dtype`` from published (name, tensor) pairs, built on the meta device."""
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    with torch.device("meta"):
        model = Transformer(args)
    state = published_to_internal(tensors, args)
    check_state(model, state, Path(source))
    state = {name: tensor.to(device=device, dtype=dtype) for name, tensor in state.items()}
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def save_consolidated(model: Transformer, folder: str | Path) -> None:
    """Write params.json and consolidated.safetensors with the published names."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = internal_to_published(model.state_dict(), model.args)
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    params = model.args.to_params()
    params.pop("max_batch_size", None)
    (folder / PARAMS_FILE).write_text(json.dumps(params, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, str(folder / SAFETENSORS_FILE))
