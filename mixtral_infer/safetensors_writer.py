"""Writing a .safetensors file one tensor at a time.

``safetensors.torch.save_file`` wants every tensor in memory at once. The format
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
import struct
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

import torch

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
