"""Compiled decode steps of float32 mixtral-bench with and without the package's few-row kernels
(``Tuning.float_dots``: ``kernels/float_dots.cpp``'s products and its experts' operator), alternating.

Two copies of one random model (``bench_vs_transformers.ours_alone``), the machine's tuning with
``float_dots`` on and off; per batch (``--batches``), random 64-token prompts, 64 greedy new tokens
through ``generate(..., decode="compiled")`` (each copy's step built first, or read from the build
cache), the copies taking turns, ``--rounds`` rounds: tokens/s of each run (``bench_decode_modes``'
``alternating_tok_s``) and their medians.

    .venv/bin/python bench/bench_float_steps.py --out bench/results_float_steps.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode_modes import alternating_tok_s  # noqa: E402
from bench_speculative import machine  # noqa: E402
from bench_vs_transformers import bench_args, ours_alone, random_prompts  # noqa: E402

from mixtral_infer.formats.measured import machine_tuning  # noqa: E402
from mixtral_infer.formats.modules import use_formats  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    tuning = machine_tuning(floats=True)
    if not tuning.float_dots:
        sys.exit("this machine's tuning does not take the few-row kernels (float_dots): nothing to compare")
    kernels = ours_alone(bench_args("mixtral-bench"))
    without = use_formats(copy.deepcopy(kernels), dataclasses.replace(tuning, float_dots=False))
    results = {"machine": machine(), "options": {k: str(v) for k, v in vars(options).items()}, "batches": {}}
    for batch in options.batches:
        prompts = random_prompts(batch, 64, kernels.args.vocab_size, seed=batch)
        runs = alternating_tok_s({"float_dots": kernels, "without": without}, prompts, options.rounds, new_tokens=64)
        medians = {name: statistics.median(r) for name, r in runs.items()}
        results["batches"][batch] = {"runs_tok_s": runs, "median_tok_s": medians}
        print(f"batch {batch}: " + ", ".join(f"{name} {m:.1f} tok/s {[round(v, 1) for v in runs[name]]}" for name, m in medians.items()), flush=True)
    if options.out:
        options.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
