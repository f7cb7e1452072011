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
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from mixtral_infer.errors import CheckpointError
from mixtral_infer.parallel import Selection

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


Selector = Callable[[str], Optional[Selection]]


def apply_selection(tensor: torch.Tensor, selection: Selection) -> torch.Tensor:
    """The part of ``tensor`` a selection keeps, as a tensor of its own."""
    if selection.rows is None and selection.columns is None:
        return tensor
    if selection.rows is not None:
        tensor = tensor[selection.rows]
    if selection.columns is not None:
        tensor = tensor[:, selection.columns]
    return tensor.clone()


def iter_tensors(path: str | Path, select: Optional[Selector] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) for the file's tensors, in file order, each read on demand.

    ``select(name)`` may skip a tensor (None: its bytes are never read) or keep a
    part of it: a row range is read as one byte range, columns are cut after reading.
    """
    path = Path(path)
    entries = sorted(read_header(path), key=lambda e: e.begin)
    with open(path, "rb") as handle:
        for entry in entries:
            selection = select(entry.name) if select is not None else Selection()
            if selection is None:
                continue
            shape, begin = entry.shape, entry.begin
            if selection.rows is not None and shape:
                rows = range(shape[0])[selection.rows]
                row_bytes = (entry.end - entry.begin) // max(shape[0], 1)
                shape, begin = (len(rows), *shape[1:]), entry.begin + rows.start * row_bytes
            tensor = torch.empty(shape, dtype=entry.dtype)
            if tensor.numel():
                buffer = tensor.view(-1).view(torch.uint8).numpy()
                handle.seek(begin)
                if handle.readinto(memoryview(buffer)) != buffer.nbytes:
                    raise CheckpointError(f"{path}: truncated while reading tensor {entry.name}")
            yield entry.name, apply_selection(tensor, Selection(columns=selection.columns))


def tensor_shapes(path: str | Path) -> Dict[str, Tuple[int, ...]]:
    return {entry.name: entry.shape for entry in read_header(path)}
