"""Conversations served from their cache: the serving engine with prefix reuse against the same
engine reading every prompt whole (``prefix_reuse=False``), in the same run, alternating.

Three scenarios, each on ``--models`` (default: the shipped tiny-mixtral, window 32, and
``mistral-bench`` of ``bench_vs_transformers.py``, random weights, window 256):

- **chat**: one conversation of ``--turns`` turns (default 8), each adding ``--turn-tokens`` user
  tokens (default 300) and an answer of ``--answer-tokens`` (default 32, EOS ignored). Time to first
  token of each turn, with and without reuse; from the second turn on, a turn with reuse reads its
  new tokens only (and its answer's last token), past the window too.
- **system**: a shared system prompt of ``--system-tokens`` (default 1000) and ``--users`` users
  (default 32) with different 30-token questions, all arriving at once on 8 rows: prompt tokens read
  and mean time to first token.
- **unshared**: 32 requests that share nothing (random prompts of 40-200 tokens, 32 new tokens): the
  throughput with reuse on (the matching costs something, nothing is found) over reuse off.

Each scenario runs ``--repeat`` times (default 3), on and off alternating, and reports the median.
Random token ids stand for text (the models are random too): the work per token is the same.

    python bench/bench_prefix_reuse.py --out bench/results_prefix_reuse.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_serve import FoldedTokenizer  # noqa: E402
from bench_vs_transformers import bench_args, machine_info, ours_alone  # noqa: E402

from mixtral_infer import Tokenizer, load_model  # noqa: E402
from mixtral_infer.serve.engine import Engine, RequestSettings, TokenEvent  # noqa: E402


def model_named(name: str):
    """The shipped model, or a bench shape with random weights (tiny-mixtral's tokenizer, ids beyond it
    folded in for detokenization, as in bench_serve.py)."""
    if name == "tiny-mixtral":
        return load_model(name, dtype=torch.float32, device="cpu"), Tokenizer.from_folder(name)
    return ours_alone(bench_args(name)), FoldedTokenizer.from_folder("tiny-mixtral")


def ids(rng: random.Random, n: int, vocab: int) -> List[int]:
    return [rng.randrange(3, min(vocab, 2000)) for _ in range(n)]


def finish(engine: Engine) -> None:
    while engine.step():
        pass


def chat(model, tokenizer, reuse: bool, turns: int, turn_tokens: int, answer_tokens: int, seed: int) -> Dict:
    """Time to first token of each turn of one conversation."""
    rng = random.Random(seed)
    engine = Engine(model, tokenizer, rows=2, decode="eager", prefix_reuse=reuse)
    prompt: List[int] = [1]
    ttft = []
    for _ in range(turns):
        prompt = prompt + ids(rng, turn_tokens, model.args.vocab_size)
        events: List = []
        started = time.perf_counter()
        first = []

        def sink(event, first=first, events=events):
            if isinstance(event, TokenEvent) and not first:
                first.append(time.perf_counter())
            events.append(event)

        engine.submit(prompt, RequestSettings(max_tokens=answer_tokens, ignore_eos=True), sink)
        finish(engine)
        ttft.append(first[0] - started)
        prompt = prompt + [e.token for e in events if isinstance(e, TokenEvent)]
    return {"ttft_s": ttft, "prompt_tokens": len(prompt), "reused_tokens": engine.reused_tokens}


def system_prompt(model, tokenizer, reuse: bool, system_tokens: int, users: int, seed: int) -> Dict:
    """A shared system prompt and ``users`` questions arriving at once."""
    rng = random.Random(seed)
    system = [1] + ids(rng, system_tokens - 1, model.args.vocab_size)
    prompts = [system + ids(rng, 30, model.args.vocab_size) for _ in range(users)]
    engine = Engine(model, tokenizer, rows=8, decode="eager", prefill_tokens=512, prefix_reuse=reuse)
    firsts: Dict[int, float] = {}
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, RequestSettings(max_tokens=8, ignore_eos=True),
                      lambda e, i=i: firsts.setdefault(i, time.perf_counter()) if isinstance(e, TokenEvent) else None)  # fmt: skip
    finish(engine)
    read = sum(len(p) for p in prompts) - engine.reused_tokens
    return {"prompt_tokens_read": read, "mean_ttft_s": statistics.mean(t - started for t in firsts.values()),
            "wall_s": time.perf_counter() - started}  # fmt: skip


def unshared(model, tokenizer, reuse: bool, seed: int) -> Dict:
    """Throughput of 32 requests that share nothing but their first token, on 8 rows."""
    rng = random.Random(seed)
    prompts = [[1] + ids(rng, rng.randrange(40, 200), model.args.vocab_size) for _ in range(32)]
    engine = Engine(model, tokenizer, rows=8, decode="eager", prefill_tokens=512, prefix_reuse=reuse)
    generated = [0]

    def sink(event):
        if isinstance(event, TokenEvent):
            generated[0] += 1

    started = time.perf_counter()
    for prompt in prompts:
        engine.submit(prompt, RequestSettings(max_tokens=32, ignore_eos=True), sink)
    finish(engine)
    wall = time.perf_counter() - started
    return {"tokens_per_s": generated[0] / wall, "wall_s": wall}


def median_run(runs: List[Dict], key: str) -> Dict:
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[len(ordered) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-mixtral", "mistral-bench"])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None)
    options = ap.parse_args()
    if options.threads:
        torch.set_num_threads(options.threads)
    results = {"machine": machine_info(), "torch": torch.__version__, "threads": torch.get_num_threads(), "models": {}}
    for name in options.models:
        model, tokenizer = model_named(name)
        out = results["models"][name] = {"window": model.args.sliding_window}
        runs: Dict[str, List[Dict]] = {}
        with torch.inference_mode():
            for round_ in range(options.repeat):
                for reuse in ((True, False) if round_ % 2 == 0 else (False, True)):
                    tag = "on" if reuse else "off"
                    runs.setdefault(f"chat_{tag}", []).append(
                        chat(model, tokenizer, reuse, options.turns, options.turn_tokens, options.answer_tokens, seed=round_))
                    runs.setdefault(f"system_{tag}", []).append(
                        system_prompt(model, tokenizer, reuse, options.system_tokens, options.users, seed=round_))
                    runs.setdefault(f"unshared_{tag}", []).append(unshared(model, tokenizer, reuse, seed=round_))
                    print(f"{name} round {round_ + 1} reuse {tag}: "
                          f"chat last turn {runs[f'chat_{tag}'][-1]['ttft_s'][-1] * 1e3:.0f} ms, "
                          f"system {runs[f'system_{tag}'][-1]['prompt_tokens_read']} tokens read, "
                          f"unshared {runs[f'unshared_{tag}'][-1]['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)  # fmt: skip
        for tag in ("on", "off"):
            turns = list(zip(*[r["ttft_s"] for r in runs[f"chat_{tag}"]]))
            out[f"chat_ttft_ms_reuse_{tag}"] = [round(statistics.median(t) * 1e3, 2) for t in turns]
            out[f"system_reuse_{tag}"] = median_run(runs[f"system_{tag}"], "mean_ttft_s")
            out[f"unshared_reuse_{tag}"] = median_run(runs[f"unshared_{tag}"], "tokens_per_s")
        on, off = out["chat_ttft_ms_reuse_on"], out["chat_ttft_ms_reuse_off"]
        out["chat_ttft_ratio_off_over_on"] = [round(b / a, 2) for a, b in zip(on, off)]
        out["unshared_throughput_on_over_off"] = round(statistics.median(
            a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["unshared_on"], runs["unshared_off"])), 3)  # fmt: skip
        out["system_ttft_ratio_off_over_on"] = round(
            out["system_reuse_off"]["mean_ttft_s"] / out["system_reuse_on"]["mean_ttft_s"], 2)  # fmt: skip
        print(json.dumps({name: out}, indent=1), flush=True)
    if options.out:
        Path(options.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("MIXTRAL_INFER_MEASURE", "0")  # the same choices in every run: Tuning()'s defaults
    main()
