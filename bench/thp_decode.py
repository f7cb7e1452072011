"""Compiled CPU decode with PyTorch's large allocations in transparent huge pages, or not.

    THP_MEM_ALLOC_ENABLE=1 python bench/thp_decode.py FOLDER float32 none
    THP_MEM_ALLOC_ENABLE=0 python bench/thp_decode.py FOLDER bfloat16 int8

``THP_MEM_ALLOC_ENABLE=1`` makes PyTorch's CPU allocator align allocations of 2 MB and more to 2 MB
and ask the kernel for huge pages there (``madvise``), so a weight is read through fewer TLB
entries. It is read once, before the first allocation: it has to be set before Python starts, so
run this once with each value, alternating. One process: batch 1, a 4-token prompt, 130 tokens
decoded compiled (the step built first), 5 runs timed from the first token
(``bench_decode_modes.decode_seconds``); prints one line with the median, tokens/s.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_decode_modes import decode_seconds  # noqa: E402

from mixtral_infer import generate, load_model  # noqa: E402


def main() -> None:
    folder, dtype, quantize = sys.argv[1], getattr(torch, sys.argv[2]), None if sys.argv[3] == "none" else sys.argv[3]
    model = load_model(folder, dtype=dtype, device="cpu", max_batch_size=1, pack="columns", quantize=quantize)
    prompt = [[1, 2, 3, 4]]
    generate(prompt, model, decode="compiled", max_tokens=130)  # builds the step for this shape
    runs = []
    for _ in range(5):  # the tokens after the first, over their time
        runs.append(round(129 / decode_seconds(model, prompt, "compiled", 130), 1))
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    huge = huge_pages_mb()
    median = statistics.median(runs)
    print(f"{sys.argv[2]} {quantize} THP_MEM_ALLOC_ENABLE={thp} huge pages {huge} MB tok/s median {median} runs {runs}")


def huge_pages_mb() -> int:
    """This process's memory in transparent huge pages (``AnonHugePages``), MB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) // 1024
    return 0


if __name__ == "__main__":
    main()
