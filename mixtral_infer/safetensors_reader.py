"""Reading a .safetensors file one tensor at a time, straight into fresh tensors.

``safe_open`` memory-maps the whole file, and the pages it touches count as
resident memory until it is closed, so loading through it peaks near twice the
model. Here each tensor's bytes are read with ``readinto`` into a tensor of its
own: loading holds one copy of the model plus the tensor being converted.

The layout: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the data, offsets counted from the end of the header.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import torch

from mixtral_infer.errors import CheckpointError

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 << 20


@dataclass
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int


def read_header(path: str | Path) -> List[TensorEntry]:
    """The tensors a file holds, checked against the file's size; raises CheckpointError."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated (no safetensors header)")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: not a safetensors file, or truncated (header of {header_size} bytes)")
            header = json.loads(handle.read(header_size))
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read ({error.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header")
    data_start = 8 + header_size
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name}") from None
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != expected or begin < 0:
            raise CheckpointError(f"{path}: tensor {name} has {end - begin} bytes, its shape {shape} needs {expected}")
        if data_start + end > size:
            raise CheckpointError(f"{path}: truncated: tensor {name} ends past the end of the file")
        entries.append(TensorEntry(name, dtype, shape, data_start + begin, data_start + end))
    return entries


def iter_tensors(path: str | Path) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the file, in file order, each read on demand."""
    path = Path(path)
    entries = sorted(read_header(path), key=lambda e: e.begin)
    with open(path, "rb") as handle:
        for entry in entries:
            tensor = torch.empty(entry.shape, dtype=entry.dtype)
            buffer = tensor.view(-1).view(torch.uint8).numpy() if tensor.numel() else None
            handle.seek(entry.begin)
            if buffer is not None and handle.readinto(memoryview(buffer)) != entry.end - entry.begin:
                raise CheckpointError(f"{path}: truncated while reading tensor {entry.name}")
            yield entry.name, tensor


def tensor_shapes(path: str | Path) -> Dict[str, Tuple[int, ...]]:
    return {entry.name: entry.shape for entry in read_header(path)}
