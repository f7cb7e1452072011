"""Writing safetensors: Hugging Face shards through the library, one Mistral file by hand.

**Hugging Face folders** (``write_hf_shards``) are written as transformers writes them:
tensors are gathered into shards of at most ``max_shard_size`` bytes, each shard is
written by ``safetensors.torch.save_file`` to a temporary name and renamed into place
once every shard is complete (``model-00001-of-00003.safetensors`` ... plus
``model.safetensors.index.json``; a model that fits one shard is ``model.safetensors``).
Only one shard is in memory at a time, and every byte is written once.

**A Mistral folder** has a single ``consolidated.safetensors``, which
``safetensors.torch.save_file`` could only write with the whole model in memory
(``bench/convert_memory.py``, a 1.71 GB float32 checkpoint: 1722 MB peak anonymous memory
written as one shard through the library, 474 MB streamed by hand; but 10 s instead of 3-4 s
and twice the disk). That measured reason keeps ``write_safetensors`` here. The format
is simple enough to stream: an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the raw bytes.
The bytes go to a side file as tensors arrive; the header, known only at the end,
is written first into the final file and the bytes are copied after it, tensor by
tensor in name order: the same tensors always give the same file, byte for byte.
The result appears under its name only when complete (written as ``.partial``,
then renamed).
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


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def write_safetensors(
    path: str | Path,
    tensors: Iterable[Tuple[str, torch.Tensor]],
    metadata: Optional[Dict[str, str]] = None,
) -> int:
    """Stream ``(name, tensor)`` pairs into ``path``; returns the number of tensors written."""
    path = Path(path)
    data_path = path.with_name(path.name + ".data.partial")
    final_partial = path.with_name(path.name + ".partial")
    written: Dict[str, Tuple[str, list, int, int]] = {}  # name -> (dtype, shape, start in side file, size)
    offset = 0
    try:
        with open(data_path, "wb") as data:
            for name, tensor in tensors:
                if name in written:
                    raise ValueError(f"tensor {name} written twice")
                if tensor.dtype not in DTYPE_NAMES:
                    raise ValueError(f"tensor {name}: dtype {tensor.dtype} cannot be stored in safetensors")
                raw = tensor_bytes(tensor)
                data.write(raw)
                written[name] = (DTYPE_NAMES[tensor.dtype], list(tensor.shape), offset, len(raw))
                offset += len(raw)
        header: Dict[str, object] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        position = 0
        for name in sorted(written):
            dtype, shape, _, size = written[name]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + size]}
            position += size
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned
        with open(final_partial, "wb") as out, open(data_path, "rb") as data:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            for name in sorted(written):
                _, _, start, size = written[name]
                data.seek(start)
                _copy_bytes(data, out, size)
        os.replace(final_partial, path)
    finally:
        for leftover in (data_path, final_partial):
            if leftover.exists():
                leftover.unlink()
    return len(written)


def _copy_bytes(source, target, size: int, block: int = 16 << 20) -> None:
    while size > 0:
        chunk = source.read(min(block, size))
        if not chunk:
            raise OSError("side file ended early")
        target.write(chunk)
        size -= len(chunk)


HF_WEIGHTS_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # transformers 4's default; the hub's Mistral folders use about 5 GB
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.I)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


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


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor that shares memory with no other (``save_file`` refuses shared tensors:
    the experts cut from a fused ``gate_up_proj`` are views of one storage)."""
    tensor = (tensor.detach() if tensor.requires_grad else tensor).to("cpu").contiguous()  # self when already so
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def plan_shards(sizes: Sequence[int], limit: int) -> List[int]:
    """The shard number (from 1) of each tensor: a shard closes when the next tensor would take it past
    ``limit`` bytes; a tensor larger than the limit gets a shard of its own.

    >>> plan_shards([400, 400, 600, 1200, 100], limit=1000)
    [1, 1, 2, 3, 4]
    """
    plan: List[int] = []
    number, filled, members = 1, 0, 0  # the shard being filled: its bytes and tensors so far
    for size in sizes:
        if members and filled + size > limit:
            number, filled, members = number + 1, 0, 0
        plan.append(number)
        filled, members = filled + size, members + 1
    return plan


def write_hf_shards(
    folder: str | Path,
    tensors: Iterable[Tuple[str, torch.Tensor]],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Optional[Dict[str, str]] = None,
    sizes: Optional[Sequence[int]] = None,
) -> List[Path]:
    """Write ``(name, tensor)`` pairs into ``folder`` as transformers' ``save_pretrained`` does.

    ``sizes``: the byte size of each tensor to come, in order, known before any is
    read (``convert`` takes them from the source's headers). The shards are planned
    from them (``plan_shards``), so each shard's final name ``model-0000i-of-0000N``
    is known when it is complete: it is written to a hidden ``.partial`` name and
    renamed at once, before the next tensor is asked for. Only the shard being filled
    is in memory. Without ``sizes`` the
    tensors are gathered first, as transformers does from a state dict (use it for
    tensors already in memory). Returns the weight files written.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    limit = parse_size(max_shard_size)
    if sizes is None:
        tensors = [(name, _own_storage(tensor)) for name, tensor in tensors]
        sizes = [tensor.nbytes for _, tensor in tensors]
    plan = plan_shards(sizes, limit)
    count = plan[-1] if plan else 1
    names = [HF_WEIGHTS_FILE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    weight_map: Dict[str, int] = {}  # name -> shard number
    shard: Dict[str, torch.Tensor] = {}
    partial = folder / ".shard.safetensors.partial"
    written: List[Path] = []

    def write(number: int) -> None:
        nonlocal shard
        save_file(shard, str(partial), metadata=metadata)
        os.replace(partial, folder / names[number - 1])
        written.append(folder / names[number - 1])
        shard = {}

    try:
        position = -1
        for position, (name, tensor) in enumerate(tensors):
            if position >= len(plan) or tensor.nbytes != sizes[position]:
                expected = f"{sizes[position]} bytes" if position < len(plan) else f"only {len(plan)} tensors"
                raise ValueError(f"tensor {name} ({tensor.nbytes} bytes) does not match the planned sizes ({expected})")
            if name in weight_map:
                raise ValueError(f"tensor {name} written twice")
            shard[name] = _own_storage(tensor)
            weight_map[name] = plan[position]
            if position + 1 == len(plan) or plan[position + 1] != plan[position]:  # the shard is complete
                write(plan[position])
        if position + 1 != len(plan):
            raise ValueError(f"{position + 1} tensors written, {len(plan)} planned")
        if not plan:
            write(1)  # no tensors: an empty model.safetensors, as transformers writes
    except BaseException:
        for path in written:  # a folder with some of the shards would look like a model
            path.unlink()
        raise
    finally:
        if partial.exists():
            partial.unlink()
    if count > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": {name: names[i - 1] for name, i in sorted(weight_map.items())}}
        (folder / HF_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [folder / name for name in names]
