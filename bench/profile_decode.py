"""Where one decode step of mixtral_infer spends its time, apart from reading weights.

    python bench/profile_decode.py [--model mixtral-bench] [--batch 1 8] [--steps 20] [--tiny]

For each batch size: prefill random 64-token prompts (as bench_vs_transformers.py does), then
profile ``--steps`` decode steps with ``torch.profiler`` (self CPU time per op, top rows) and with
cProfile (Python functions, cumulative time), and time the same steps on a *tiny* copy of the model
(dim 64, hidden 64, vocab 256, same layers/heads-per-KV/experts/window), whose weights are so small
that its step time is almost all fixed per-step cost: Python, metadata, allocations, op dispatch.
That "overhead floor" is what a step would cost if reading weights were free.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_transformers import MODELS, PROMPT_LEN, bench_args, ours_alone, random_prompts  # noqa: E402

from mixtral_infer import ModelArgs  # noqa: E402
from mixtral_infer.generation.generate import prefill  # noqa: E402


def tiny_copy(args: ModelArgs) -> ModelArgs:
    return ModelArgs(
        dim=64, n_layers=args.n_layers, head_dim=16, hidden_dim=64, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
        norm_eps=args.norm_eps, vocab_size=256, max_batch_size=args.max_batch_size,
        sliding_window=args.sliding_window, moe=args.moe,
    )  # fmt: skip


@torch.inference_mode()
def primed(model, batch: int, new_tokens: int):
    prompts = random_prompts(batch, PROMPT_LEN, model.args.vocab_size, seed=3)
    cache = model.make_cache(batch, max_seqlen=PROMPT_LEN + new_tokens)
    cache.start_sequences(batch)
    logits = prefill(model, cache, prompts, model.args.sliding_window)
    return cache, logits.argmax(-1)


@torch.inference_mode()
def step_times(model, batch: int, steps: int) -> list:
    cache, tokens = primed(model, batch, steps + 4)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        tokens = model(tokens, [1] * batch, cache).argmax(-1)
        times.append(time.perf_counter() - start)
    return times


@torch.inference_mode()
def profile(model, batch: int, steps: int, rows: int) -> None:
    cache, tokens = primed(model, batch, 2 * steps + 8)
    for _ in range(3):
        tokens = model(tokens, [1] * batch, cache).argmax(-1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            tokens = model(tokens, [1] * batch, cache).argmax(-1)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        tokens = model(tokens, [1] * batch, cache).argmax(-1)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(rows)
    print(out.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mixtral-bench", choices=MODELS)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--no-profile", action="store_true", help="only the step times (big and tiny model)")
    cli = parser.parse_args()
    args = bench_args(cli.model, max_batch_size=max(cli.batch))
    model = ours_alone(args)
    tiny = ours_alone(tiny_copy(args))
    for batch in cli.batch:
        big_ms = statistics.median(step_times(model, batch, cli.steps)) * 1e3
        tiny_ms = statistics.median(step_times(tiny, batch, max(cli.steps, 50))) * 1e3
        print(f"== {cli.model} batch {batch}: {big_ms:.1f} ms/step; tiny copy (fixed cost floor) {tiny_ms:.2f} ms/step")
        if not cli.no_profile:
            profile(model, batch, cli.steps, cli.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
