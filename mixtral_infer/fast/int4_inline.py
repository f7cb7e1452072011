"""int4 weights with their scales inline, as the CPU's integer dot products read them
(``kernels/int_dots.cpp``, ``kernels.linear.int_dots``).

Each row is cut into chunks of 256 inputs; a chunk holds the scales of its groups, then its 128 bytes
of nibbles as ``quant.weights`` stores them (byte ``j`` of the row: input ``2j`` in the low nibble,
``2j + 1`` in the high one). Decoding reads every weight once a token, a few rows at a time: with the
scales in a tensor of their own, each row read is two streams of memory, its nibbles and its scales,
and the scales' stream (an eighth of the bytes in groups of 32) cost more than its size; with the
scales inline a row is one stream (docs/performance.md, section 6).

The scales are stored as bfloat16 where every one of them is a bfloat16 number (``quantize`` rounds
them so), else as float32 (the float16 scales of a GGUF file): a chunk is ``256 / G`` scales of 2 or 4
bytes, then 128 bytes. A row of ``IN`` inputs has ``ceil(IN / 256)`` chunks, the last one's missing
scales and bytes zero. The bytes hold the numbers themselves, so ``model.to(dtype)`` leaves them as
they are (the kernel reads the 2 or 4 bytes of a scale from the row's width).

Example: a row of 320 inputs in groups of 32 with bfloat16 scales ``s[0..9]`` is 2 chunks of
``8 * 2 + 128 = 144`` bytes: chunk 0 is ``s[0..7]`` then bytes 0-127 of the plain row; chunk 1 is
``s[8], s[9]`` and six zero scales, then bytes 128-159 and 96 zero bytes. 288 bytes a row, where the
plain layout holds 160 bytes of nibbles and 20 of scales.
"""

from __future__ import annotations

from typing import Optional

import torch

CHUNK = 256  # inputs a chunk: 8 blocks of the activations' 32
CHUNK_NIBBLES = CHUNK // 2  # bytes of nibbles a chunk


def stored_dtype(scales: torch.Tensor) -> torch.dtype:
    """bfloat16 where every scale is one exactly, else float32 (which holds float16's exactly). It
    reads the scales: ``inline_scales`` is told the dtype where that cannot be (compiled code)."""
    return torch.bfloat16 if torch.equal(scales.to(torch.bfloat16).to(scales.dtype), scales) else torch.float32


def row_bytes(in_features: int, group: int, scale_size: int) -> int:
    """The bytes of one row: ``ceil(IN / 256)`` chunks of ``256 / G`` scales of ``scale_size`` bytes
    and 128 bytes of nibbles."""
    return -(-in_features // CHUNK) * (CHUNK // group * scale_size + CHUNK_NIBBLES)


def inline_scales(values: torch.Tensor, scales: torch.Tensor, group: int, stored: Optional[torch.dtype] = None) -> torch.Tensor:
    """The plain layout ``values (..., OUT, IN/2)`` uint8 and ``scales (..., OUT, IN/G)`` in the
    inline one: ``(..., OUT, row_bytes)`` uint8 (module docstring), the scales stored as ``stored``
    (bfloat16 or float32; None: ``stored_dtype``)."""
    *lead, out, half = values.shape
    chunks, per = -(-half // CHUNK_NIBBLES), CHUNK // group
    kept = scales.to(stored if stored is not None else stored_dtype(scales)).contiguous()
    header = per * kept.element_size()
    rows = torch.zeros(*lead, out, chunks, header + CHUNK_NIBBLES, dtype=torch.uint8, device=values.device)
    whole, rest = divmod(half, CHUNK_NIBBLES)  # chunks of 256 inputs, and the inputs of the last one
    rows[..., :whole, header:] = values[..., : whole * CHUNK_NIBBLES].unflatten(-1, (whole, CHUNK_NIBBLES))
    if rest:
        rows[..., whole, header : header + rest] = values[..., whole * CHUNK_NIBBLES :]
    padded = torch.nn.functional.pad(kept, (0, chunks * per - kept.shape[-1]))  # (..., OUT, chunks * per)
    rows[..., :header] = padded.view(torch.uint8).unflatten(-1, (chunks, header))
    return rows.flatten(-2)


def _chunks(rows: torch.Tensor, in_features: int, group: int) -> tuple[torch.Tensor, int, torch.dtype]:
    """``rows`` as ``(..., OUT, chunks, chunk bytes)``, the bytes of a chunk's scales, and their dtype."""
    chunks = -(-in_features // CHUNK)
    for dtype in (torch.bfloat16, torch.float32):
        if rows.shape[-1] == row_bytes(in_features, group, dtype.itemsize):
            header = CHUNK // group * dtype.itemsize
            return rows.unflatten(-1, (chunks, header + CHUNK_NIBBLES)), header, dtype
    raise ValueError(f"rows of {rows.shape[-1]} bytes are not the inline layout of {in_features} inputs in groups of {group}")


def plain_values(rows: torch.Tensor, in_features: int, group: int) -> torch.Tensor:
    """The plain ``values (..., OUT, IN/2)`` back from ``inline_scales``'s rows (a copy)."""
    chunked, header, _ = _chunks(rows, in_features, group)
    return chunked[..., header:].flatten(-2)[..., : in_features // 2].contiguous()


def inline_scale_values(rows: torch.Tensor, in_features: int, group: int) -> torch.Tensor:
    """The scales ``(..., OUT, IN/G)`` that ``inline_scales`` wrote, in the dtype it wrote them in."""
    chunked, header, dtype = _chunks(rows, in_features, group)
    return chunked[..., :header].contiguous().view(dtype).flatten(-2)[..., : in_features // group]


def with_float32_scales(rows: torch.Tensor, in_features: int, group: int) -> torch.Tensor:
    """``rows`` with their scales stored as float32 (as they are where already so): experts laid out
    one by one, some with bfloat16 scales and some not, stacked in one width."""
    scales = inline_scale_values(rows, in_features, group)
    if scales.dtype == torch.float32:
        return rows
    return inline_scales(plain_values(rows, in_features, group), scales, group, torch.float32)
