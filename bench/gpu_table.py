"""One table of the GPU decode rows against their targets, from ``bench_gpu.py``'s JSON files.

    python bench/gpu_table.py bench/results_gpu_h200_mixtral_int8.json bench/results_gpu_h200_mistral_quant.json

Each row: model, scheme (bfloat16 or the quantization), batch, ours (the compiled step) in tok/s,
the floor measured in the same run where the run has one (every matrix a step reads, read once),
ours' share of it, the target and whether it is met. Targets (an H200, issue 66): Mixtral-8x7B at
batch 1 bfloat16 140, int8 230, int4 300 tok/s; Mistral-7B at batch 1 int8 380, int4 500; at batch 8
and 32, 80% of the floor; a first compile of at most 60 s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

TARGETS: Dict[Tuple[str, str], float] = {  # (model, scheme) at batch 1 -> tok/s
    ("mixtral-8x7b", "bfloat16"): 140,
    ("mixtral-8x7b", "int8"): 230,
    ("mixtral-8x7b", "int4"): 300,
    ("mistral-7b", "int8"): 380,
    ("mistral-7b", "int4"): 500,
}
FLOOR_SHARE = 0.8  # batches 8 and up: this share of the floor
COMPILE_SECONDS = 60


def rows(results: dict) -> Iterator[Tuple[str, str, int, float, Optional[float], Optional[float]]]:
    """``(model, scheme, batch, tok/s, floor, compile seconds)`` of the compiled step's rows."""
    grouped = " grouped" if results.get("grouped_experts") else ""  # bench_gpu.py --grouped-experts
    triton = " triton" if results.get("triton_experts") or results.get("triton_dense") else ""  # --triton-experts, --triton-dense
    for model, entry in results["models"].items():
        for row in entry.get("decode", []):
            if "ours_fast" in row:
                yield model, "bfloat16" + grouped + triton, row["batch"], row["ours_fast"], row.get("floor"), row.get("ours_fast_compile_s")
        for row in entry.get("quantized", []):
            if "ours_fast" in row:
                scheme = row["scheme"].replace("-gemlite", "") + (" gathered" if row.get("gathered_int8_experts") else "") + triton
                yield model, scheme, row.get("batch", 1), row["ours_fast"], row.get("floor"), row.get("ours_fast_compile_s")


def target_of(model: str, scheme: str, batch: int, floor: Optional[float]) -> Tuple[Optional[float], str]:
    """The target in tok/s and how it is set (a variant, ``int8 gathered``, has its scheme's)."""
    base = scheme.split(" ")[0]
    if batch == 1 and (model, base) in TARGETS:
        return TARGETS[(model, base)], "tok/s"
    if batch >= 8 and floor is not None:
        return FLOOR_SHARE * floor, f"{FLOOR_SHARE:.0%} of the floor"
    return None, ""


def table(paths: List[Path]) -> str:
    lines = ["| model | scheme | batch | ours tok/s | floor tok/s | share | target | met | first compile |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for path in paths:
        for model, scheme, batch, ours, floor, compile_s in rows(json.loads(Path(path).read_text())):
            target, how = target_of(model, scheme, batch, floor)
            share = f"{ours / floor:.0%}" if floor else "-"
            met = "-" if target is None else ("yes" if ours >= target else "no")
            compiled = "-" if compile_s is None else f"{compile_s:.0f} s" + (" (over 60)" if compile_s > COMPILE_SECONDS else "")
            floor_text = "-" if floor is None else f"{floor:.1f}"
            target_text = "-" if target is None else f"{target:.0f} {how}"
            lines.append(f"| {model} | {scheme} | {batch} | {ours:.1f} | {floor_text} | {share} | {target_text} | {met} | {compiled} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python bench/gpu_table.py RESULTS.json [...]")
    print(table([Path(p) for p in sys.argv[1:]]))
