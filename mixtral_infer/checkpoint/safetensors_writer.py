"""Writing safetensors: Hugging Face shards through the library, one Mistral file by hand.

Both writers take the tensors as a stream, one at a time, with a **plan**: the name,
dtype and shape of every tensor to come, in order, known before any is read
(``convert.planned_tensors`` works it out from the source's headers, as tensors on the
meta device). Without a plan, the tensors are gathered first and are their own plan,
as transformers plans ``save_pretrained`` from a state dict: use that for tensors that
are in memory anyway. A stream that differs from its plan is a ValueError.

**Hugging Face folders** (``write_hf_shards``) are written as transformers writes them:
tensors are gathered into shards of at most ``max_shard_size`` bytes (``plan_shards``),
each shard is written by ``safetensors.torch.save_file`` to a hidden ``.partial`` name
and renamed to ``model-0000i-of-0000N.safetensors`` as soon as it is complete, before the
next tensor is read; then ``model.safetensors.index.json``. A model that fits one shard is
``model.safetensors``. Only one shard is in memory at a time, and every byte is written once.

**A Mistral folder** has a single ``consolidated.safetensors``. The library writes a file
only from all of its tensors at once (``save_file(dict)``; it has no streaming writer), so
this file is written here, by hand: one ``save_file`` call would hold the whole model in
memory, a stream holds one tensor (docs/performance.md, "Loading: memory and time"). With the
plan, the header is known first, so the file is written in one pass: the header, then each
tensor's bytes at its offset as it arrives, under ``.partial`` until complete.
The format: an 8-byte little-endian header length, the JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the raw bytes.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from mixtral_infer.errors import ConfigError

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

NamedTensors = Iterable[Tuple[str, torch.Tensor]]
Plan = Sequence[Tuple[str, torch.Tensor]]  # (name, a tensor of the dtype and shape to come; meta is fine)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that shares memory with no other (``save_file`` refuses shared tensors:
    the experts cut from a fused ``gate_up_proj`` are views of one storage)."""
    tensor = (tensor.detach() if tensor.requires_grad else tensor).to("cpu").contiguous()  # self when already so
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _gathered(tensors: NamedTensors, plan: Optional[Plan]) -> Tuple[NamedTensors, Plan]:
    """The tensors and their plan: the given one, or the tensors themselves, gathered."""
    if plan is not None:
        return tensors, plan
    tensors = list(tensors)
    return tensors, tensors


def _planned(tensors: NamedTensors, plan: Plan) -> Iterable[Tuple[int, str, torch.Tensor]]:
    """(position, name, tensor) for each tensor of the stream, each checked against the plan."""
    names = set()
    for position, (name, tensor) in enumerate(tensors):
        if position >= len(plan):
            raise ValueError(f"tensor {name} comes after the {len(plan)} planned")
        expected, like = plan[position]
        if (name, tensor.dtype, tensor.shape) != (expected, like.dtype, like.shape):
            raise ValueError(
                f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} differs from the plan: {expected} {like.dtype} {tuple(like.shape)}"
            )
        if name in names:
            raise ValueError(f"tensor {name} written twice")
        names.add(name)
        yield position, name, tensor
    if len(names) != len(plan):
        raise ValueError(f"{len(names)} tensors written, {len(plan)} planned")


def write_safetensors(
    path: str | Path, tensors: NamedTensors, metadata: Optional[Dict[str, str]] = None, plan: Optional[Plan] = None
) -> int:
    """Stream ``(name, tensor)`` pairs into one file ``path`` in one pass; returns the number of tensors written.

    The tensors lie in the file in name order, whatever order they arrive in (each is
    written at its offset), so the same tensors always give the same file, byte for byte.
    """
    path = Path(path)
    tensors, plan = _gathered(tensors, plan)
    header: Dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    position = 0
    for name, like in sorted(plan, key=lambda pair: pair[0]):
        if like.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name}: dtype {like.dtype} cannot be stored in safetensors")
        if name in header:
            raise ValueError(f"tensor {name} written twice")
        header[name] = {"dtype": DTYPE_NAMES[like.dtype], "shape": list(like.shape), "data_offsets": [position, position + like.nbytes]}
        position += like.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned
    data_start = 8 + len(encoded)
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as out:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            for _, name, tensor in _planned(tensors, plan):
                flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # (numel,)
                out.seek(data_start + header[name]["data_offsets"][0])
                out.write(memoryview(flat.view(torch.uint8).numpy()))
        os.replace(partial, path)
    finally:
        if partial.exists():
            partial.unlink()
    return len(plan)


HF_WEIGHTS_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # transformers 4's default; the hub's Mistral folders use about 5 GB
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.I)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def current_umask() -> int:
    """The process's umask (read by setting it, then setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string as transformers' ``max_shard_size`` takes it.

    >>> parse_size("5GB"), parse_size("100KB"), parse_size("2MiB"), parse_size(1234)
    (5000000000, 100000, 2097152, 1234)
    """
    match = _SIZE.match(size) if isinstance(size, str) else None
    value = int(size) if not isinstance(size, str) else int(float(match[1]) * _UNITS[(match[2] or "B").upper()]) if match else 0
    if value <= 0:
        raise ConfigError(f"max_shard_size={size!r}: expected a positive size such as 5GB, 500MB or a number of bytes")
    return value


def plan_shards(sizes: Sequence[int], limit: int) -> List[int]:
    """The shard number (from 1) of each tensor: a shard closes when the next tensor would take it past
    ``limit`` bytes; a tensor larger than the limit gets a shard of its own.

    >>> plan_shards([400, 400, 600, 1200, 100], limit=1000)
    [1, 1, 2, 3, 4]
    """
    shards: List[int] = []
    number, filled, members = 1, 0, 0  # the shard being filled: its bytes and tensors so far
    for size in sizes:
        if members and filled + size > limit:
            number, filled, members = number + 1, 0, 0
        shards.append(number)
        filled, members = filled + size, members + 1
    return shards


def write_hf_shards(
    folder: str | Path,
    tensors: NamedTensors,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Optional[Dict[str, str]] = None,
    plan: Optional[Plan] = None,
) -> List[Path]:
    """Write ``(name, tensor)`` pairs into ``folder`` as transformers' ``save_pretrained`` does.

    Each shard is renamed to its final name as soon as it is written, before the next
    tensor is asked for; if writing fails, the shards already written are removed.
    Returns the weight files written.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    limit = parse_size(max_shard_size)
    tensors, plan = _gathered(tensors, plan)
    shard_of = plan_shards([like.nbytes for _, like in plan], limit)
    count = shard_of[-1] if shard_of else 1
    names = [HF_WEIGHTS_FILE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    partial = folder / ".shard.safetensors.partial"
    written: List[Path] = []

    def write(shard: Dict[str, torch.Tensor], number: int) -> None:
        save_file(shard, str(partial), metadata=metadata)
        os.chmod(partial, 0o666 & ~current_umask())  # the library writes 0600: readable as the folder's other files
        os.replace(partial, folder / names[number - 1])
        written.append(folder / names[number - 1])

    try:
        shard: Dict[str, torch.Tensor] = {}
        for position, name, tensor in _planned(tensors, plan):
            shard[name] = _own_storage(tensor)
            if position + 1 == len(plan) or shard_of[position + 1] != shard_of[position]:  # the shard is complete
                write(shard, shard_of[position])
                shard = {}
        if not plan:
            write({}, 1)  # no tensors: an empty model.safetensors, as transformers writes
    except BaseException:
        for path in written:  # a folder with some of the shards would look like a model
            path.unlink()
        raise
    finally:
        if partial.exists():
            partial.unlink()
    if count > 1:
        weight_map = {name: names[shard_of[i] - 1] for i, (name, _) in enumerate(plan)}
        index = {"metadata": {"total_size": sum(like.nbytes for _, like in plan)}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / HF_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [folder / name for name in names]
