"""Reading a .safetensors file through the ``safetensors`` library, after checking its header here.

A header is hostile input. ``read_header`` parses and checks all of it first, cheaply
(the JSON is at most ``MAX_HEADER_BYTES``; Mixtral 8x7B's are about 100 KB): every entry,
every offset, no overlap, no gap, so a bad file is one ``CheckpointError`` line naming
the file and the tensor, before the library opens it and before any tensor memory is
allocated. The library's own messages (``invalid shape, data type, or offset for
tensor``) name neither.

Then ``safetensors.safe_open`` memory-maps the file, and each tensor, or the rows or
columns of it a rank keeps (``get_slice``), is copied out of the map into memory of its
own: the model does not depend on the file once loaded, and a rank's share touches
only its pages. The file is opened once per tensor, so those pages are unmapped right
after the copy (``_read`` says why).

The layout: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the data, offsets counted from the end of the header.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open

from mixtral_infer.errors import CheckpointError
from mixtral_infer.checkpoint.shares import Selection

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
MAX_HEADER_BYTES = 100 << 20  # the limit the safetensors format itself sets
MAX_NESTING = 32  # JSON depth; a real header is 3 deep (name -> entry -> shape list)
MAX_DIMS = 16  # a tensor of more dimensions is not a model weight
HEADER_KEYS = {"dtype", "shape", "data_offsets"}


@dataclass
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int


ShapeCheck = Callable[[str, Tuple[int, ...]], None]  # raises CheckpointError when a tensor does not fit the model

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def _nesting_depth(text: str) -> int:
    """How deeply the JSON text nests arrays and objects (strings skipped), without parsing it."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if match[0] in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _no_duplicate_keys(pairs: List[Tuple[str, object]]) -> dict:
    result = {}
    for key, value in pairs:
        if key in result:
            raise CheckpointError(f"key {key!r} appears twice")
        result[key] = value
    return result


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(raw: bytes, data_size: int) -> List[TensorEntry]:
    """The entries of ``parse_header_and_metadata``."""
    return parse_header_and_metadata(raw, data_size)[0]


def parse_header_and_metadata(raw: bytes, data_size: int) -> Tuple[List[TensorEntry], Dict[str, str]]:
    """Validate a safetensors JSON header before any tensor byte is read; entries in file order.

    ``data_size`` is the number of bytes after the header. Every entry must have a
    known dtype, a shape of at most ``MAX_DIMS`` non-negative ints, and
    ``data_offsets`` ``[begin, end]`` with ``0 <= begin <= end <= data_size`` and
    ``end - begin = prod(shape) * dtype size``; sorted by ``begin``, the entries
    cover the data exactly, without overlap or gap (as the ``safetensors`` library
    requires). Names appear once. Raises CheckpointError (without the path) otherwise. Also the
    header's ``__metadata__`` (names to strings; empty where it has none).

    >>> entries = parse_header(b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', 8)
    >>> [(e.name, e.shape, e.begin, e.end) for e in entries]
    [('a', (2,), 0, 8)]
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError("corrupt safetensors header (not UTF-8 JSON)") from None
    if _nesting_depth(text) > MAX_NESTING:
        raise CheckpointError(f"corrupt safetensors header (JSON nested deeper than {MAX_NESTING} levels)")
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except CheckpointError as error:
        raise CheckpointError(f"corrupt safetensors header: {error}") from None
    except (json.JSONDecodeError, RecursionError, ValueError):
        raise CheckpointError("corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt safetensors header (a JSON {type(header).__name__}, expected an object)")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError("corrupt safetensors header: __metadata__ must map names to strings")
    entries = [_entry(name, info, data_size) for name, info in header.items()]
    previous: Optional[TensorEntry] = None
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if previous is not None and entry.begin < previous.end:
            raise CheckpointError(
                f"corrupt safetensors header: tensors {previous.name} and {entry.name} share bytes "
                f"[{entry.begin}, {min(entry.end, previous.end)})"
            )
        end = previous.end if previous is not None else 0
        if entry.begin > end:
            raise CheckpointError(f"corrupt safetensors header: data bytes [{end}, {entry.begin}) before tensor {entry.name} belong to no tensor")
        previous = entry
    end = previous.end if previous is not None else 0
    if end != data_size:
        raise CheckpointError(f"corrupt safetensors header: the last {data_size - end} data bytes belong to no tensor")
    return entries, metadata


def _entry(name: str, info: object, data_size: int) -> TensorEntry:
    where = f"corrupt safetensors header: tensor {name!r}"
    if not name:
        raise CheckpointError("corrupt safetensors header: a tensor has an empty name")
    if not isinstance(info, dict) or set(info) != HEADER_KEYS:
        keys = sorted(info) if isinstance(info, dict) else type(info).__name__
        raise CheckpointError(f"{where}: expected the keys {sorted(HEADER_KEYS)}, got {keys}")
    dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise CheckpointError(f"{where}: dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape {_short(shape)} must be a list of at most {MAX_DIMS} integers >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise CheckpointError(f"{where}: data_offsets {_short(offsets)} must be [begin, end], two integers")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] must have 0 <= begin <= end")
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(f"{where} has {end - begin} bytes, its shape {tuple(shape)} in {dtype_name} needs {expected}")
    if end > data_size:
        raise CheckpointError(f"truncated: tensor {name} ends past the end of the file ({end} > {data_size} data bytes)")
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_header(path: str | Path) -> List[TensorEntry]:
    """The tensors a file holds, checked against the file's size (``parse_header``); raises CheckpointError."""
    return read_header_and_metadata(path)[0]


def read_metadata(path: str | Path) -> Dict[str, str]:
    """The file's ``__metadata__`` (``convert --quantize`` records its scheme there), its header checked."""
    return read_header_and_metadata(path)[1]


def read_header_and_metadata(path: str | Path) -> Tuple[List[TensorEntry], Dict[str, str]]:
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
            raw = handle.read(header_size)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read ({error.strerror})") from None
    try:
        entries, metadata = parse_header_and_metadata(raw, size - 8 - header_size)
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {error}") from None
    data_start = 8 + header_size
    return [TensorEntry(e.name, e.dtype, e.shape, data_start + e.begin, data_start + e.end) for e in entries], metadata


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


def iter_tensors(
    path: str | Path, select: Optional[Selector] = None, check: Optional[ShapeCheck] = None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) for the file's tensors, in file order, each read on demand.

    The header is checked first (``read_header``), then ``check(name, shape)`` runs
    for every tensor, all before the library opens the file: a tensor the model has
    no place for, or of another shape, stops the load before memory is spent on it.
    ``select(name)`` may skip a tensor (None: its bytes are never read) or keep a
    part of it, sliced through ``get_slice`` so that only those rows (or columns) are
    read. Each tensor is copied out of the file's memory map into memory of its own.
    """
    path = Path(path)
    entries = sorted(read_header(path), key=lambda e: e.begin)
    if check is not None:
        for entry in entries:
            check(entry.name, entry.shape)
    for entry in entries:
        selection = select(entry.name) if select is not None else Selection()
        if selection is not None:
            yield entry.name, _read(path, entry, selection)


def _read(path: Path, entry: TensorEntry, selection: Selection) -> torch.Tensor:
    """The selected part of one tensor, copied out of the file's memory map.

    The file is opened for this one tensor, so closing it unmaps the pages the copy
    touched. With one handle for the whole file, every page read stays mapped, and
    resident, until the end: the file-backed peak is then the whole checkpoint rather than
    its largest tensor. Opening the file again for each tensor costs little beside reading it
    (docs/performance.md, "Loading: memory and time").
    """
    try:
        with safe_open(path, framework="pt") as handle:
            part = handle.get_slice(entry.name)
            if tuple(part.get_shape()) != entry.shape:  # the file was replaced after its header was checked
                raise CheckpointError(f"{path}: tensor {entry.name} changed while loading (now {tuple(part.get_shape())})")
            if not entry.shape or (selection.rows is None and selection.columns is None):
                view = handle.get_tensor(entry.name)
            else:
                rows = selection.rows if selection.rows is not None else slice(None)
                view = part[(rows,) if selection.columns is None else (rows, selection.columns)]
            return view.clone(memory_format=torch.contiguous_format)  # (rows, columns) of the file's tensor
    except (SafetensorError, OSError) as error:  # the file changed since its header was checked
        raise CheckpointError(f"{path}: cannot read ({_first_line(error)})") from None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__

