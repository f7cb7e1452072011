"""Compiled CPU decoding with long rows in column blocks against plain weights, one process alternating.

    python bench/bench_column_blocks.py --model mistral-wide --quantize none int8 float32 --rounds 6
    python bench/bench_column_blocks.py --model mistral-wide --max-block 4096 2048

``fast/cpu_column_blocks.py`` keeps weights whose rows are longer than ``MAX_BLOCK`` (2048: at
Mistral 7B's widths, every matrix) as contiguous blocks of columns for the compiled step's
products. ``--max-block`` compares copies blocked at each of the given widths instead of a plain
and a blocked copy (``max4096``: only rows longer than 4096 blocked, as before 2048). This loads one
random model of bench_vs_transformers.py's shape (``mistral-wide``: 4 layers of Mistral 7B's widths;
``mixtral-wide``: 2 layers of Mixtral 8x7B's, about 6 GB per copy in bfloat16; ``--quantize``
``none`` is bfloat16, ``float32`` float32 weights, ``int8`` int8 weight-only), keeps a copy with
its long rows in blocks, and alternates ``generate(..., decode="compiled")`` on the two (random
64-token prompt, 128 greedy new tokens, timed from the first new token to the last), printing
tokens/s and the medians. Each copy compiles through its own code object, so neither pays for
checking the other's guards.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import types
from pathlib import Path
from typing import List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_decode_modes import decode_seconds  # noqa: E402
from bench_vs_transformers import bench_args, ours_alone, random_prompts  # noqa: E402

from mixtral_infer.fast import cpu_column_blocks  # noqa: E402
from mixtral_infer.fast.cpu_column_blocks import int8_blocks  # noqa: E402
from mixtral_infer.formats.packing import block_long_rows, blocked_numel
from mixtral_infer.formats.quantizing import quantize_model  # noqa: E402
from mixtral_infer.quant.weights import QuantizedParameter  # noqa: E402

NEW_TOKENS = 128


def compiled_apart(label: str):
    """``torch.compile`` for one copy: the function it is given, as a code object of its own."""
    compile_ = torch.compile

    def compile_own(fn, **options):
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{label}")
        own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        return compile_(own, **options)

    return compile_own


def numel_in_blocks(model) -> int:
    """Weights held in column blocks: float parameters and int8 integers."""
    integers = [int8_blocks(m) for m in model.modules() if isinstance(m, QuantizedParameter)]
    return blocked_numel(model) + sum(blocks.numel() for blocks in integers if blocks is not None)


def tokens_per_second(model, prompts, label: str) -> float:
    compile_ = torch.compile
    torch.compile = compiled_apart(label)
    try:
        return len(prompts) * (NEW_TOKENS - 1) / decode_seconds(model, prompts, "compiled", NEW_TOKENS)
    finally:
        torch.compile = compile_


def copies(plain, max_blocks: Optional[List[int]]) -> dict:
    """``{"plain": plain, "columns": blocked copy}``, or one copy blocked at each ``MAX_BLOCK`` width
    (the last one ``plain`` itself, so that at most two models are held: Mixtral's widths are large)."""
    if not max_blocks:
        return {"plain": plain, "columns": block_long_rows(copy.deepcopy(plain))}
    models, default = {}, cpu_column_blocks.MAX_BLOCK
    try:
        for i, width in enumerate(max_blocks):
            cpu_column_blocks.MAX_BLOCK = width
            models[f"max{width}"] = block_long_rows(copy.deepcopy(plain) if i < len(max_blocks) - 1 else plain)
    finally:
        cpu_column_blocks.MAX_BLOCK = default
    return models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mistral-wide", choices=["mistral-wide", "mixtral-wide"])
    parser.add_argument("--quantize", nargs="+", default=["none", "int8"], choices=["none", "int8", "float32"],
                        help="none (bfloat16), int8 (weight-only, bfloat16 activations), float32 (not quantized)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--max-block", type=int, nargs="+", default=None,
                        help="copies blocked at these MAX_BLOCK widths (e.g. 4096 2048), not plain and blocked")
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    results = {}  # "<quantize> batch <B>" -> plain / columns -> median, runs
    for quantize in cli.quantize:
        dtype = torch.float32 if quantize == "float32" else torch.bfloat16
        plain = ours_alone(bench_args(cli.model, max_batch_size=cli.batch)).to(dtype)
        if quantize == "int8":
            quantize_model(plain, quantize)
        models = copies(plain, cli.max_block)
        for label, model in models.items():
            blocked = numel_in_blocks(model) / 1e6
            print(f"{cli.model} {quantize} {label}: {blocked:.0f}M weights in column blocks", flush=True)
        prompts = random_prompts(cli.batch, 64, plain.args.vocab_size, seed=1)
        for label, model in models.items():
            tokens_per_second(model, prompts, label)  # compiles
        runs = {label: [] for label in models}
        for _ in range(cli.rounds):
            for label, model in models.items():
                runs[label].append(round(tokens_per_second(model, prompts, label), 2))
        for label, values in runs.items():
            median = statistics.median(values)
            line = f"{cli.model} {quantize:5s} batch {cli.batch} {label:8s} median {median:6.1f} tok/s  runs {values}"
            print(line, flush=True)
        key = f"{quantize} batch {cli.batch}"
        results[key] = {k: {"median": statistics.median(v), "runs": v} for k, v in runs.items()}
        del plain, models  # and what compiled them, before the next pair is made
        torch._dynamo.reset()
        gc.collect()
    if cli.out:
        record = {"model": cli.model, "torch": torch.__version__, "max_block": cli.max_block, "results": results}
        Path(cli.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
