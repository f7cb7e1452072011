"""What a JSON-schema constraint costs a decode step: a batch of 8 rows with and without one, in
the same run, alternating.

Paths: ``generate()`` eager, ``generate()`` compiled (the shaped fixed-shape step; on CPU built by
AOTInductor, compiled once before timing), and the serving engine (eager steps; the mask applied to
the step's logits before sampling). The schema asks for one string of at least 2,000 characters, so
no row ends within the 64 tokens timed and both runs decode the same number of steps; EOS is
ignored. Tokens/s = rows x tokens / seconds; the cost is 1 - constrained / free.

    python bench/bench_structured.py --out bench/results_structured.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_prefix_reuse import model_named  # noqa: E402
from bench_vs_transformers import machine_info  # noqa: E402

from mixtral_infer import generate  # noqa: E402
from mixtral_infer.serve.engine import Engine, RequestSettings  # noqa: E402
from mixtral_infer.structured.grammar import Constraint  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}}, "required": ["text"]}
ROWS, TOKENS = 8, 64


def timed_generate(model, tokenizer, decode: str, constrained: bool) -> float:
    prompts = [[1] + [100 + i + j for j in range(16)] for i in range(ROWS)]
    extra = dict(json_schema=SCHEMA, tokenizer=tokenizer) if constrained else {}
    started = time.perf_counter()
    generated, _ = generate(prompts, model, max_tokens=TOKENS, decode=decode, temperature=0.8, seed=0, eos_id=None,
                            prompt_logprobs=False, **extra)  # fmt: skip
    elapsed = time.perf_counter() - started
    assert all(len(g) == TOKENS for g in generated)
    return ROWS * TOKENS / elapsed


def timed_engine(model, tokenizer, constrained: bool) -> float:
    engine = Engine(model, tokenizer, rows=ROWS, decode="eager")
    constraint = Constraint("json_schema", SCHEMA) if constrained else None
    count = [0]
    for i in range(ROWS):
        settings = RequestSettings(max_tokens=TOKENS, temperature=0.8, seed=i, ignore_eos=True, constraint=constraint)
        engine.submit([1] + [100 + i + j for j in range(16)], settings, lambda e: count.__setitem__(0, count[0] + 1))
    started = time.perf_counter()
    while engine.step():
        pass
    return ROWS * TOKENS / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-mixtral", "mistral-bench"])
    ap.add_argument("--paths", nargs="+", default=["eager", "compiled", "engine"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None)
    options = ap.parse_args()
    results: Dict = {"machine": machine_info(), "rows": ROWS, "tokens": TOKENS, "models": {}}
    for name in options.models:
        model, tokenizer = model_named(name)
        model.args.max_batch_size = ROWS
        out = results["models"][name] = {}
        with torch.inference_mode():
            for path in options.paths:
                run = (lambda c: timed_engine(model, tokenizer, c)) if path == "engine" else (
                    lambda c: timed_generate(model, tokenizer, path, c))  # fmt: skip
                run(False), run(True)  # warm-up: compiles the steps, makes llguidance's tokenizer
                pairs: List = []
                for round_ in range(options.repeat):
                    order = (False, True) if round_ % 2 == 0 else (True, False)
                    got = {c: run(c) for c in order}
                    pairs.append((got[False], got[True]))
                    print(f"{name} {path}: free {got[False]:.1f} tok/s, constrained {got[True]:.1f} tok/s", file=sys.stderr, flush=True)
                out[path] = {
                    "free_tok_s": [round(a, 1) for a, _ in pairs],
                    "constrained_tok_s": [round(b, 1) for _, b in pairs],
                    "cost_median": round(statistics.median(1 - b / a for a, b in pairs), 3),
                }
        print(json.dumps({name: out}, indent=1), flush=True)
    if options.out:
        Path(options.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("MIXTRAL_INFER_MEASURE", "0")
    main()
