"""Prompts with glibc's default heap against the heap kept between prompts (mixtral_infer/memory.py).

One process, one model, the two settings in alternation (ABBA), each timed prefill of one prompt
after an untimed one in the same setting; prints each run, the medians and the page faults a
prompt took (``getrusage``), and writes them to ``--out``:

    python bench/bench_heap.py FOLDER --dtype float32 --rounds 3 --out bench/results_heap.json

"default" is glibc's own state once large blocks have been freed (its dynamic thresholds at
their largest: blocks over 32 MB get fresh pages, 64 MB kept at the heap's top), set back with
``mallopt``; "kept" is ``keep_freed_memory()``, what ``load_model`` does on CPU.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_vs_transformers as b  # noqa: E402

from mixtral_infer import load_model, memory  # noqa: E402

GLIBC_MAX_MMAP_THRESHOLD = 32 << 20  # where glibc's dynamic threshold stops rising (64-bit)


def set_heap(kept: bool) -> None:
    if kept:
        memory.keep_freed_memory()
    else:
        memory._LIBC.mallopt(memory.M_MMAP_THRESHOLD, GLIBC_MAX_MMAP_THRESHOLD)
        memory._LIBC.mallopt(memory.M_TRIM_THRESHOLD, 2 * GLIBC_MAX_MMAP_THRESHOLD)
    memory.release_freed_memory()  # neither setting starts with the other's kept pages


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length, prefilled in one chunk")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if memory._LIBC is None:
        sys.exit("bench_heap.py: glibc's heap settings only (Linux)")
    model = load_model(cli.folder, max_batch_size=1, device="cpu", dtype=getattr(torch, cli.dtype))
    prompt = b.random_prompts(1, cli.tokens, model.args.vocab_size, seed=7)[0]
    runs = {"default": [], "kept": []}
    prompt_faults = {"default": [], "kept": []}
    for r in range(cli.rounds):
        for name in ("default", "kept") if r % 2 == 0 else ("kept", "default"):
            set_heap(name == "kept")
            b.ours_chunked_prefill(model, prompt, cli.tokens)  # untimed: the setting's first prompt
            before, start = faults(), time.perf_counter()
            b.ours_chunked_prefill(model, prompt, cli.tokens)
            runs[name].append(cli.tokens / (time.perf_counter() - start))
            prompt_faults[name].append(faults() - before)
            print(f"{name:8s} {runs[name][-1]:8.1f} tok/s  {prompt_faults[name][-1]:9d} page faults", flush=True)
    out = {
        "folder": cli.folder, "dtype": cli.dtype, "tokens": cli.tokens, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "runs_tok_s": runs, "page_faults": prompt_faults,
        "median_tok_s": {k: statistics.median(v) for k, v in runs.items()},
    }  # fmt: skip
    print(json.dumps(out["median_tok_s"]))
    if cli.out:
        with open(cli.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
