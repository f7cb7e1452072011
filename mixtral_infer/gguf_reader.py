"""A GGUF file opened by the ``gguf`` package's reader: parsed once, over plain numpy slices, and
refused in one line where it cannot be read.

The command line reads a GGUF file four times over: its checkpoint's metadata, its tokenizer, and in
``load_model`` the checkpoint again and the vocabulary check (``checkpoint/gguf_file.py``,
``tokenizer/gguf_vocab.py``). ``open_reader`` gives the reader already open where one is still held
(by an open ``GgufFile``: the command line holds its checkpoint while it reads the tokenizer and loads
the model), keyed by the file's identity: its path, size, inode and modification and change times.
A file written again is parsed again; one rewritten in place while its reader is held, keeping all
of those (``ctime`` cannot be set back), would not be. It holds no reader itself (a weak
reference): the mapped file, whose pages count in the process's resident memory once read, goes
with the last reader's user.

``gguf.GGUFReader`` makes its metadata of numpy slices of the file's memory map, two per string
of a vocabulary (32,000 strings in Mistral 7B's, 131,072 in tekken's). A slice of an ``np.memmap``
runs Python code (``memmap.__getitem__``, ``__array_finalize__``), a slice of a plain ``ndarray``
over the same mapping does not: the reader here holds ``data`` as that plain view, and every array it
gives (fields and tensors) is an ``ndarray`` over the mapped file, read as before
(docs/performance.md, section 17).
"""

from __future__ import annotations

import functools
import re
import stat
import weakref
from pathlib import Path

import numpy as np

from mixtral_infer.errors import CheckpointError

_OPEN: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()  # the readers still held


def open_reader(path: str | Path):
    """``gguf.GGUFReader`` over ``path`` (parsed once while the file stays as it is, module docstring);
    CheckpointError in one line naming the file where it cannot be read (not a GGUF file, a truncated
    header, a tensor type the reader does not know or whose bytes pass the file's end)."""
    path = Path(path)
    try:
        found = path.stat()
    except OSError:
        found = None
    if found is None or not stat.S_ISREG(found.st_mode):
        raise CheckpointError(f"{path}: file not found")
    key = (str(path.resolve()), found.st_size, found.st_ino, found.st_mtime_ns, found.st_ctime_ns)
    reader = _OPEN.get(key)
    if reader is None:
        try:
            reader = _OPEN[key] = _parsed(str(path))
        except CheckpointError as error:
            raise CheckpointError(f"{path}: {error}") from None
    return reader


def _parsed(path: str):
    """The reader of ``path``; its errors without the file's name, which ``open_reader`` puts first."""
    try:
        from gguf import GGUFReader
    except ImportError:  # pragma: no cover - a dependency
        raise CheckpointError("reading GGUF files needs the gguf package (pip install gguf)") from None
    try:
        return _checked_reader(GGUFReader)(path, "r")
    except ValueError as error:
        text = str(error).splitlines()[0] if str(error) else type(error).__name__
        unknown = re.search(r"(\d+)\)? is not a valid GGMLQuantizationType", text)
        if unknown:  # the reader stops at the first such tensor, before naming it
            raise CheckpointError(f"a tensor has unknown type {unknown[1]} (not a GGML type this gguf package reads)") from None
        raise CheckpointError(f"not a readable GGUF file, or truncated ({text})") from None
    except (OSError, IndexError, KeyError, TypeError) as error:
        raise CheckpointError(f"not a readable GGUF file, or truncated ({type(error).__name__}: {error})") from None


@functools.cache
def _checked_reader(base: type) -> type:
    """``GGUFReader`` over plain slices (module docstring) that names the tensor whose type it does not
    know, or whose bytes pass the end of the file: its private ``_build_tensors`` gets each tensor's
    info as (name length, name, dims count, dims, type, offset) first (read in gguf 0.17-0.19; info of
    another shape is left to the reader, whose own error ``open_reader`` turns into one line)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    known = {int(t) for t in GGMLQuantizationType}

    class CheckedReader(base):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:  # the reader's np.memmap of the file
            self._plain = mapped.view(np.ndarray)

        def _build_tensors(self, start_offs, fields):
            for entry in fields:
                parts = getattr(entry, "parts", None)
                if parts is None or len(parts) != 6:
                    continue
                name, kind = bytes(parts[1]).decode("utf-8", "replace"), int(parts[4][0])
                if kind not in known:
                    raise CheckpointError(f"tensor {name} has unknown type {kind} (not a GGML type this gguf package reads)")
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                end = int(start_offs) + int(parts[5][0]) + int(np.prod(parts[3], dtype=np.int64)) * size // block
                if end > len(self.data):
                    raise CheckpointError(f"truncated: tensor {name} ends at byte {end}, the file has {len(self.data)}")
            return super()._build_tensors(start_offs, fields)

    return CheckedReader


def field(reader, key: str, default: object = None) -> object:
    """The value of metadata ``key`` (a number, a string or a list), ``default`` where absent."""
    entry = reader.get_field(key)
    if entry is None:
        return default
    return entry.contents()
