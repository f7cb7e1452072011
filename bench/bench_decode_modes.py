"""Decode modes on the CPU: eager loop, static step op by op, static step compiled (float32).

    python bench/bench_decode_modes.py --out bench/results_decode_modes.json

The bench shapes of ``bench_vs_transformers.py`` (mixtral-bench, mistral-bench), random 64-token
prompts, 128 greedy new tokens through ``generate(..., decode=MODE)``; timed from the first new
token to the last; the modes alternate, median of ``--repeats`` runs after one warm-up each (the
compiled mode's warm-up compiles). This decides ``decode="auto"`` on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_vs_transformers import MODELS, bench_args, ours_alone, random_prompts  # noqa: E402

from mixtral_infer import generate  # noqa: E402

MODES = ("eager", "static", "compiled")


def decode_seconds(model, prompts, mode: str, new_tokens: int) -> float:
    first = []
    generate(prompts, model, max_tokens=new_tokens, decode=mode, prompt_logprobs=False,
             on_token=lambda i, t: first or first.append(time.perf_counter()))  # fmt: skip
    return time.perf_counter() - first[0]


def alternating_tok_s(models: dict, prompts, rounds: int, new_tokens: int) -> dict:
    """Compiled decode of ``new_tokens`` after ``prompts`` by each of ``models`` in turn, ``rounds``
    times: tokens/s of every run (the tokens after each row's first, over their time), by name."""
    runs = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            runs[name].append(len(prompts) * (new_tokens - 1) / decode_seconds(model, prompts, "compiled", new_tokens))
    return runs


def copies_parser(description: str) -> argparse.ArgumentParser:
    """The options of the scripts that time copies of one model folder, each built another way,
    alternating (``reduction_streams.py``, ``moe_experts.py``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def report_copies(runs: dict, out: Path | None, **fields) -> None:
    """``fields`` with the versions, the median and every run of ``runs`` (tokens/s by copy), printed
    as one JSON line and appended to ``out``."""
    row = {**fields, "torch": torch.__version__, "threads": torch.get_num_threads(),
           "tok_s": {name: round(statistics.median(r), 1) for name, r in runs.items()},
           "runs": {name: [round(v, 1) for v in r] for name, r in runs.items()}}  # fmt: skip
    print(json.dumps(row))
    if out:
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    options = parser.parse_args(argv)
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": []}
    for name in options.models:
        model = ours_alone(bench_args(name))
        for batch in options.batches:
            prompts = random_prompts(batch, 64, model.args.vocab_size, seed=batch)
            timings = {mode: [] for mode in MODES}
            warm = {mode: decode_seconds(model, prompts, mode, options.new_tokens) for mode in MODES}
            for _ in range(options.repeats):
                for mode in MODES:
                    timings[mode].append(decode_seconds(model, prompts, mode, options.new_tokens))
            row = {"model": name, "batch": batch, "compiled_warmup_s": warm["compiled"]}
            for mode in MODES:
                row[f"{mode}_tok_s"] = batch * (options.new_tokens - 1) / statistics.median(timings[mode])
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
    if options.out is not None:
        options.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
