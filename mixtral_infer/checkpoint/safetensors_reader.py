"""Reading a .safetensors file: its header checked once per read, then each tensor read from its bytes.

A header is hostile input, checked in two passes before any tensor memory is allocated:

- The ``safetensors`` library's own parser (``safe_open``, once) reads it first. It refuses wrong
  JSON types, unknown dtypes, offsets that overlap, leave gaps or run past the file, and headers over
  its limit, without building Python objects: 90 MB of ``[[], [], ...]`` under ``__metadata__`` is
  refused at once, where ``json.loads`` spends seconds and GBs building it.
- Then ``parse_header`` here, for what the library lets through (a name given twice, which it reads
  as the last; keys of an entry it skips; an empty name; dtypes and ranks no weight has) and, where
  the library refused, to say which tensor and why: one ``CheckpointError`` line naming the file and
  the tensor, which the library's messages (``invalid shape, data type, or offset for tensor``) may
  name neither of. Its offset checks repeat the library's: they cover the bytes read below, through
  our own handle, and cost little beside parsing the JSON.

Then each tensor, or the rows of it a rank keeps, is read from its byte range straight into
memory of its own, with one unbuffered handle per file, not through the library's memory map: with
one map per file every page read stays mapped, and resident, until the file is closed (the whole
file, where reads into memory of our own keep none), and a file cut while mapped kills the process
(SIGBUS) where a short read is one error line. The model does not depend on the file once loaded.

The layout: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the data, offsets counted from the end of the header.
"""

from __future__ import annotations

import json
import math
import os
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
MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library sets
DIAGNOSED_HEADER_BYTES = 1 << 20  # larger headers the library finds not JSON of its schema are not parsed here
MAX_DIMS = 16  # a tensor of more dimensions is not a model weight
HEADER_KEYS = {"dtype", "shape", "data_offsets"}
NOT_JSON = "corrupt safetensors header (not JSON)"  # where the library says what and where, its reason is given


@dataclass
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int


ShapeCheck = Callable[[str, Tuple[int, ...]], None]  # raises CheckpointError when a tensor does not fit the model

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
    try:  # json's C parser: a header nested past the recursion limit is a RecursionError, not a crash
        header = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except CheckpointError as error:
        raise CheckpointError(f"corrupt safetensors header: {error}") from None
    except RecursionError:
        raise CheckpointError("corrupt safetensors header (JSON nested too deeply)") from None
    except (json.JSONDecodeError, ValueError):
        raise CheckpointError(NOT_JSON) from None
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
        with open(path, "rb") as handle:
            return _parsed(path, _raw_header(handle, path))
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read ({error.strerror})") from None


def _raw_header(handle, path: Path) -> Tuple[bytes, int]:
    """The header's JSON bytes, and the file's size."""
    size = os.fstat(handle.fileno()).st_size
    handle.seek(0)
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise CheckpointError(f"{path}: truncated (no safetensors header)")
    (header_size,) = struct.unpack("<Q", prefix)
    if header_size > min(MAX_HEADER_BYTES, size - 8):
        raise CheckpointError(f"{path}: not a safetensors file, or truncated (header of {header_size} bytes)")
    return handle.read(header_size), size


def _parsed(path: Path, raw_and_size: Tuple[bytes, int]) -> Tuple[List[TensorEntry], Dict[str, str]]:
    """The header's entries (absolute offsets) and metadata, checked by the library, then here."""
    raw, size = raw_and_size
    refusal = _library_refusal(path)
    # A large header that is not JSON of the library's schema may be anything (millions of nested
    # lists): it is not built here, the library's reason stands. Should the library word its JSON
    # errors otherwise, such headers are parsed here too, as they were before the library was asked.
    unparsed = refusal is not None and refusal.startswith("invalid JSON") and len(raw) > DIAGNOSED_HEADER_BYTES
    try:
        if not unparsed:
            entries, metadata = parse_header_and_metadata(raw, size - 8 - len(raw))
    except CheckpointError as error:
        if refusal is None or str(error) != NOT_JSON:
            raise CheckpointError(f"{path}: {error}") from None
    if refusal is not None:  # too large to parse here, stricter than the checks here, or the file changed
        raise CheckpointError(f"{path}: corrupt safetensors header ({refusal})")
    data_start = 8 + len(raw)
    return [TensorEntry(e.name, e.dtype, e.shape, data_start + e.begin, data_start + e.end) for e in entries], metadata


def _library_refusal(path: Path) -> Optional[str]:
    """Why the ``safetensors`` library refuses the file's header; None where it reads it."""
    try:  # "numpy": the header only; "pt" maps the whole file privately (a 1 TB sparse file: ENOMEM)
        with safe_open(path, framework="numpy"):
            return None
    except SafetensorError as error:
        return _first_line(error).removeprefix("Error while deserializing header: ")


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
    try:
        with open(path, "rb", buffering=0) as handle:  # unbuffered: a header read again is read from the file
            raw = _raw_header(handle, path)
            entries = sorted(_parsed(path, raw)[0], key=lambda e: e.begin)
            if check is not None:
                for entry in entries:
                    check(entry.name, entry.shape)
                _check_unchanged(handle, path, raw, entries)
            for entry in entries:
                selection = select(entry.name) if select is not None else Selection()
                if selection is not None:
                    yield entry.name, _read(handle, path, entry, selection)
    except OSError as error:  # the file changed or went since its header was checked
        raise CheckpointError(f"{path}: cannot read ({error.strerror or _first_line(error)})") from None


def _check_unchanged(handle, path: Path, raw: Tuple[bytes, int], entries: List[TensorEntry]) -> None:
    """The file was rewritten while its shapes were checked: say which tensor changed (its header is
    read again; the bytes the check approved would not be the ones read)."""
    again = _raw_header(handle, path)
    if again == raw:
        return
    now = {e.name: e.shape for e in _parsed(path, again)[0]}
    changed = next((e for e in entries if now.get(e.name) != e.shape), None)
    if changed is None:
        raise CheckpointError(f"{path}: the file changed while loading")
    raise CheckpointError(f"{path}: tensor {changed.name} changed while loading (now {now.get(changed.name)})")


def _read(handle, path: Path, entry: TensorEntry, selection: Selection) -> torch.Tensor:
    """The selected part of one tensor, read from its byte range: its rows as one range, then its
    columns sliced (``Selection``)."""
    shape, begin = entry.shape, entry.begin
    if selection.rows is not None and shape:
        start, stop, step = selection.rows.indices(shape[0])
        if step != 1:  # pragma: no cover - shares are contiguous row ranges
            raise CheckpointError(f"{path}: tensor {entry.name}: a share must be a contiguous range of rows")
        row_bytes = math.prod(shape[1:]) * entry.dtype.itemsize
        begin, shape = begin + start * row_bytes, (max(stop - start, 0), *shape[1:])
    tensor = torch.empty(shape, dtype=entry.dtype)
    data = tensor.reshape(-1).view(torch.uint8)  # (bytes,) the tensor's own memory
    view, done = memoryview(data.numpy()), 0
    handle.seek(begin)
    while done < len(view):  # one read returns at most ~2 GiB
        got = handle.readinto(view[done:])
        if not got:  # the file was cut after its header was checked
            raise CheckpointError(f"{path}: tensor {entry.name} ends past the end of the file (it changed while loading)")
        done += got
    if selection.columns is not None:
        tensor = tensor[:, selection.columns].clone()  # (rows, columns) of the file's tensor
    return tensor


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__

