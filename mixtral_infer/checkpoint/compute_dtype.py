"""The dtype a model computes in when the caller does not say: the checkpoint's own, where the device can.

Published Mistral and Mixtral weights are bfloat16. Loading them in float32 doubles the
memory (Mistral 7B: 29 GB instead of 14.5), so, as transformers 5 does, a model computes in
the dtype its checkpoint stores (``stored_dtype``: the floating type holding most of its
numbers, read from the file headers), with two exceptions:

* a CPU without native arithmetic in that type (no ``avx512_bf16``/``amx_bf16`` for
  bfloat16, no ``avx512_fp16``/``amx_fp16`` for float16; Arm ``bf16``/``fphp``;
  ``hardware.cpu_info``) computes in float32, where 16-bit matmuls would be emulated and
  slow; this is said once per process on stderr;
* float64 computes in float32 (no kernel of this package is written for it).

Examples: a bfloat16 checkpoint on a CPU with avx512_bf16 -> bfloat16; on one without ->
float32 plus the message; on CUDA -> bfloat16; a float32 checkpoint anywhere -> float32.

``dtype=`` (``--dtype``) always wins. A quantized model computes in bfloat16 (the dtype of the
CPU kernels), chosen by ``load_model`` before this module is asked.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from typing import Iterable, Optional, Tuple

import torch

from mixtral_infer.hardware import cpu_info

HALF_TYPES = (torch.bfloat16, torch.float16)


def stored_dtype(tensors: Iterable[Tuple[torch.dtype, int]]) -> Optional[torch.dtype]:
    """The floating dtype holding the most numbers among ``(dtype, numel)`` pairs; None if none is floating."""
    counts: Counter = Counter()
    for dtype, numel in tensors:
        if dtype.is_floating_point:
            counts[dtype] += numel
    return counts.most_common(1)[0][0] if counts else None


@functools.lru_cache(maxsize=None)
def say_once(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def compute_dtype(stored: Optional[torch.dtype], device: torch.device) -> torch.dtype:
    """The dtype to compute in for a checkpoint stored in ``stored``, on ``device`` (module docstring)."""
    if stored not in HALF_TYPES:
        return torch.float32
    if device.type != "cpu" or stored in cpu_info().native:
        return stored
    name = str(stored).removeprefix("torch.")
    say_once(
        f"mixtral_infer: this CPU has no native {name} arithmetic, so the {name} checkpoint computes in float32 "
        f"(twice its size in memory); pass dtype=torch.{name} (--dtype {name}) to keep {name}"
    )
    return torch.float32
