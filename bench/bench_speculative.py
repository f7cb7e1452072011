"""Speculative decoding (issue 74, ``generation/speculative.py``) beside plain decoding, in the same run.

Four parts (``--parts``, all by default), each timing speculative and plain decoding alternately in
one process (the order flips every round: AB BA AB ...) and reporting the median of the per-round
ratios; the absolute figures of one part are not to be compared with another run's.

- **verify-cost**: what checking k guesses costs. After a random 200-token prompt in the cache
  (batch 1), one ``model(ids, [k + 1], cache)`` against one ``model(ids[:1], [1], cache)``, k = 1..8,
  the cache cut back before every call (``cache.tokens_seen = [200]``) so that each sees the same
  state. Models: ``mistral-wide`` of ``bench_vs_transformers.py`` (Mistral 7B's widths, 4 layers,
  random weights) in bfloat16 (oneDNN-packed, as ``load_model`` packs it) and quantized int8
  (``quantize_model``), and the shipped tiny-mixtral (float32; its window is 32, so the fed tokens
  overwrite slots the next call reads: the values differ, the work does not). The ratio
  time(k + 1) / time(1) is also the number of tokens a row must gain per verify pass to break even;
  ``tokens per step / ratio`` bounds the speedup of any proposer.
- **ngram**: greedy prompt lookup (``PromptLookup``, k = 4) on copy-heavy prompts: a passage, a
  newline, then the passage's first 8 tokens again, so that the answer may copy it. tiny-mixtral
  (float32), batch 1, 128 new tokens, ``generate(decode="eager")`` and ``decode="static"``. Tokens/s
  from the first new token to the last (the prefill is the same work on both sides); acceptance
  rate and tokens per verify pass from the proposer's ``stats``; the tokens must equal plain
  decoding's. The issue's target: 1.8x plain tokens/s.
- **draft**: tiny-mixtral with tiny-mistral drafting (``DraftModel``, adaptive k up to 4) after
  held-out verses (the end of Revelation, which neither model was trained on), greedy, 96 new
  tokens, eager and static; speedup, acceptance, tokens per pass, tokens equal to plain.
- **serve**: the serving ``Engine`` with tiny-mixtral, ``decode="eager"`` and the default ``auto``
  (on CPU the compiled decode step or the eager pass, per step), 1, 4 and 16 copy-heavy requests at
  once on as many rows, 64 new tokens each (EOS ignored), driven synchronously (submit all, then
  ``while engine.step()``). Three engines each: no draft (``plain``), ``draft="ngram"`` with the
  engine's own choice (``SpeculationPolicy``: it measures both kinds of step per batch size and
  speculates where it pays, ``policy``) and with speculation forced on every decode step
  (``forced``). Total tokens/s from the first submit to the last token; the decode-only steps, by
  batch size and kind (a step counts as speculative where it ran a verify pass), so whether the
  engine turned speculation off by itself; ``policy.describe()`` (its own measurements); and the
  tokens against ``plain``'s. Each engine serves the workload once untimed first (steps built, the
  policy's first measurements).
  Prefix reuse is off, so that every round reads its prompts again.

Threads: ``torch.set_num_threads(--threads)`` (2). ``--quick``: a smoke test (well under a minute):
``mistral-bench`` with 2 layers in place of mistral-wide, k in 1, 2, 4, 8, short answers, one
passage, the engine at 1 and 4 rows eager only, 1 round. Its numbers mean little.

    .venv/bin/python bench/bench_speculative.py --out bench/results_speculative.json

About 5 minutes on 2 quiet cores (the first run builds the engine's compiled decode steps, up to a
minute more; they are kept on disk). Other processes on the CPU stall 2-thread runs at every barrier:
the JSON's ``disturbed`` says, per part, which processes used the CPU meanwhile.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_vs_transformers import CpuWatcher, _init_, bench_args  # noqa: E402

from mixtral_infer import Tokenizer, Transformer, generate, load_model  # noqa: E402
from mixtral_infer.formats.measured import machine_tuning  # noqa: E402
from mixtral_infer.formats.modules import prepare_and_swap, use_formats  # noqa: E402
from mixtral_infer.formats.quantizing import quantize_model  # noqa: E402
from mixtral_infer.generation.speculative import DraftModel, PromptLookup, SpeculativeStats  # noqa: E402
from mixtral_infer.serve.engine import Engine, RequestSettings, TokenEvent  # noqa: E402
from mixtral_infer.serve.speculation import bucket  # noqa: E402

PARTS = ("verify-cost", "ngram", "draft", "serve")
STAT_FIELDS = ("steps", "proposed", "accepted", "emitted", "row_steps")

# Copy-heavy prompts: passages of the training text (King James Bible). The model is tiny and its
# window 32 tokens, so it does not copy a passage by itself; the lookup gains wherever the answer
# repeats the prompt or itself.
PASSAGES = [
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness "
    "was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God said, Let there "
    "be light: and there was light. And God saw the light, that it was good: and God divided the light from the "
    "darkness. And God called the light Day, and the darkness he called Night. And the evening and the morning were "
    "the first day.",
    "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures: he leadeth me beside the "
    "still waters. He restoreth my soul: he leadeth me in the paths of righteousness for his name's sake. Yea, "
    "though I walk through the valley of the shadow of death, I will fear no evil: for thou art with me; thy rod and "
    "thy staff they comfort me. Thou preparest a table before me in the presence of mine enemies: thou anointest my "
    "head with oil; my cup runneth over. Surely goodness and mercy shall follow me all the days of my life: and I "
    "will dwell in the house of the LORD for ever.",
    "In the beginning was the Word, and the Word was with God, and the Word was God. The same was in the beginning "
    "with God. All things were made by him; and without him was not any thing made that was made. In him was life; "
    "and the life was the light of men. And the light shineth in darkness; and the darkness comprehended it not.",
    "After this manner therefore pray ye: Our Father which art in heaven, Hallowed be thy name. Thy kingdom come. "
    "Thy will be done in earth, as it is in heaven. Give us this day our daily bread. And forgive us our debts, as "
    "we forgive our debtors. And lead us not into temptation, but deliver us from evil: For thine is the kingdom, "
    "and the power, and the glory, for ever. Amen.",
]
REPEATED = 8  # the passage's first tokens given again after it

# Held out from both shipped models' training (the last 2% of the verses: the end of Revelation).
HELD_OUT = [
    "And he shewed me a pure river of water of life, clear as crystal, proceeding out of the throne of God and of "
    "the Lamb.",
    "And there shall be no night there; and they need no candle, neither light of the sun; for the Lord God giveth "
    "them light: and they shall reign for ever and ever.",
    "I Jesus have sent mine angel to testify unto you these things in the churches. I am the root and the offspring "
    "of David, and the bright and morning star.",
    "And the Spirit and the bride say, Come. And let him that heareth say, Come. And let him that is athirst come. "
    "And whosoever will, let him take the water of life freely.",
]

FULL = dict(
    verify_models=("wide-bf16", "wide-int8", "tiny-mixtral"), wide="mistral-wide", wide_layers=None,
    ks=tuple(range(1, 9)), prompt_len=200, call_s=0.1, passages=len(PASSAGES), ngram_tokens=128, held_out=len(HELD_OUT),
    draft_tokens=96, serve_rows=(1, 4, 16), serve_modes=("eager", "auto"), serve_tokens=64, rounds=5,
)
QUICK = dict(
    verify_models=("wide-bf16", "wide-int8", "tiny-mixtral"), wide="mistral-bench", wide_layers=2,
    ks=(1, 2, 4, 8), prompt_len=200, call_s=0.01, passages=1, ngram_tokens=32, held_out=1, draft_tokens=24,
    serve_rows=(1, 4), serve_modes=("eager",), serve_tokens=16, rounds=1,
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def finite(value):
    """``value`` with every infinite or NaN float (the policy's unmeasured steps) as None: strict JSON."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {key: finite(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def stats_dict(stats: SpeculativeStats) -> Dict[str, float]:
    out = {name: getattr(stats, name) for name in STAT_FIELDS}
    out["acceptance_rate"] = round(stats.acceptance_rate, 4)
    out["tokens_per_step"] = round(stats.tokens_per_step, 4)
    return out


def stats_since(stats: SpeculativeStats, before: Dict[str, int]) -> SpeculativeStats:
    """What ``stats`` counted after ``before`` (its fields then)."""
    return SpeculativeStats(**{name: getattr(stats, name) - before[name] for name in STAT_FIELDS})


def snapshot(stats: SpeculativeStats) -> Dict[str, int]:
    return {name: getattr(stats, name) for name in STAT_FIELDS}


def alternate(round_: int, names: Sequence[str]) -> List[str]:
    """The order of the variants in round ``round_``: as given in even rounds, reversed in odd ones."""
    return list(names) if round_ % 2 == 0 else list(reversed(names))


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first index where ``a`` and ``b`` differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def table(title: str, header: Sequence[str], rows: List[Sequence]) -> None:
    def text(cell) -> str:
        if isinstance(cell, float):
            return f"{cell:.0f}" if abs(cell) >= 100 else f"{cell:.3g}"
        return str(cell)

    cells = [[str(h) for h in header]] + [[text(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


# --------------------------------------------------------------------------- machine


def machine() -> Dict[str, object]:
    cpu = platform.processor() or "unknown"
    flags: List[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("unknown", platform.processor()):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
                flags = [f for f in line.split(":", 1)[1].split() if f in wanted]
    except OSError:
        pass
    repo = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "mixtral_infer"], cwd=repo, capture_output=True,
                               text=True).stdout.strip()  # fmt: skip
    except OSError:
        commit, dirty = "", ""
    return {
        "cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git_commit": commit or None, "package_modified_since_commit": bool(dirty),
    }  # fmt: skip


# --------------------------------------------------------------------------- models


def random_model(name: str, dtype: torch.dtype, n_layers: Optional[int], quantize: Optional[str]) -> Transformer:
    """A bench shape (``bench_vs_transformers.SHAPES``) with random weights made in ``dtype`` (no float32
    copy), in the layouts ``load_model`` gives: bfloat16 packed for oneDNN, or quantized (``quantize_model``)."""
    args = bench_args(name, max_batch_size=1, n_layers=n_layers)
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(dtype).to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            _init_(param_name, param)
    tuning = machine_tuning()
    if quantize is None:
        return prepare_and_swap(model, tuning, pack=True).eval()
    use_formats(model, tuning)
    return quantize_model(model, quantize).eval()


def shipped(name: str) -> Transformer:
    return load_model(name, dtype=torch.float32, device="cpu")


def verify_model(label: str, config: dict) -> Transformer:
    if label == "tiny-mixtral":
        return shipped(label)
    scheme = "int8" if label.endswith("int8") else None
    return random_model(config["wide"], torch.bfloat16, config["wide_layers"], scheme)


# --------------------------------------------------------------------------- verify-cost


def verify_cost(model: Transformer, ks: Sequence[int], rounds: int, prompt_len: int, call_s: float) -> Dict[str, object]:
    """time(model over k + 1 tokens) / time(model over 1 token) after ``prompt_len`` tokens, batch 1."""
    vocab = model.args.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=generator)
    feed = torch.randint(3, vocab, (max(ks) + 1,), generator=generator)
    cache = model.make_cache(1, max_seqlen=prompt_len + max(ks) + 1)
    cache.start_sequences(1)
    model(prompt, [prompt_len], cache, logit_rows=[prompt_len - 1])

    def calls(tokens: int, reps: int) -> float:
        ids = feed[:tokens]
        started = time.perf_counter()
        for _ in range(reps):
            cache.tokens_seen = [prompt_len]  # every call sees the prompt alone
            model(ids, [tokens], cache)
        return (time.perf_counter() - started) / reps

    for tokens in [1] + [k + 1 for k in ks]:  # warm-up: each shape twice (oneDNN primitives, allocator)
        calls(tokens, 2)
    one = calls(1, 3)
    reps = max(2, round(call_s / max(one, 1e-6)))
    times: Dict[int, Dict[str, List[float]]] = {k: {"one": [], "checked": []} for k in ks}
    for round_ in range(rounds):
        for k in ks:
            for what in alternate(round_ + k, ("one", "checked")):
                times[k][what].append(calls(1 if what == "one" else k + 1, reps))
    rows = {}
    for k in ks:
        ratios = [b / a for a, b in zip(times[k]["one"], times[k]["checked"])]
        rows[str(k)] = {
            "one_token_ms": round(median(times[k]["one"]) * 1e3, 4), "k_plus_1_ms": round(median(times[k]["checked"]) * 1e3, 4),
            "ratio": round(median(ratios), 4), "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
            "best_speedup": round((k + 1) / median(ratios), 3),  # every guess accepted, the proposer free
        }  # fmt: skip
    return {"prompt_tokens": prompt_len, "calls_per_timing": reps, "rounds": rounds, "k": rows}


# --------------------------------------------------------------------------- generate


def copy_prompt(tokenizer: Tokenizer, passage: str, repeated: int = REPEATED) -> List[int]:
    """The passage, a newline, then its first ``repeated`` tokens again."""
    ids = tokenizer.encode(passage, bos=True)
    return ids + tokenizer.encode("\n", bos=False) + ids[1 : 1 + repeated]


def timed_generate(model: Transformer, prompt: List[int], max_tokens: int, mode: str, **speculative) -> tuple:
    """``(tokens, tokens/s)``: greedy, EOS not an end; tokens/s from the first new token to the last."""
    times: List[float] = []
    out, _ = generate([prompt], model, max_tokens=max_tokens, decode=mode, prompt_logprobs=False,
                      on_token=lambda row, token: times.append(time.perf_counter()), **speculative)  # fmt: skip
    return out[0], (len(times) - 1) / max(times[-1] - times[0], 1e-9)


def speculative_vs_plain(
    model: Transformer, prompts: Dict[str, List[int]], modes: Sequence[str], max_tokens: int, rounds: int,
    proposer: Callable[[], object], k: int,
) -> Dict[str, object]:
    """Plain and speculative greedy decoding of each prompt, alternating; per mode and prompt, the
    medians and the proposer's counts over every speculative run (a draft kept across runs is read as
    the difference of its ``stats``)."""
    out: Dict[str, object] = {}
    for mode in modes:
        for prompt in prompts.values():  # warm-up: each side once
            timed_generate(model, prompt, max_tokens, mode)
            timed_generate(model, prompt, max_tokens, mode, draft=proposer(), speculative_tokens=k)
        runs = {name: {"plain": [], "speculative": [], "stats": SpeculativeStats(), "identical": True, "first_difference": None}
                for name in prompts}  # fmt: skip
        for round_ in range(rounds):
            for name, prompt in prompts.items():
                plain_tokens = None
                for side in alternate(round_, ("plain", "speculative")):
                    if side == "plain":
                        plain_tokens, tok_s = timed_generate(model, prompt, max_tokens, mode)
                    else:
                        draft = proposer()
                        before = snapshot(draft.stats)
                        spec_tokens, tok_s = timed_generate(model, prompt, max_tokens, mode, draft=draft, speculative_tokens=k)
                        runs[name]["stats"].add(stats_since(draft.stats, before))
                    runs[name][side].append(tok_s)
                diff = first_difference(plain_tokens, spec_tokens)
                if diff is not None:
                    runs[name]["identical"] = False
                    runs[name]["first_difference"] = diff
        rows = {}
        for name, r in runs.items():
            ratios = [s / p for p, s in zip(r["plain"], r["speculative"])]
            rows[name] = {
                "prompt_tokens": len(prompts[name]), "new_tokens": max_tokens,
                "plain_tok_s": round(median(r["plain"]), 2), "speculative_tok_s": round(median(r["speculative"]), 2),
                "ratio": round(median(ratios), 4), "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
                **stats_dict(r["stats"]), "identical_to_plain": r["identical"], "first_difference": r["first_difference"],
            }  # fmt: skip
        out[mode] = rows
    return out


def print_generate(title: str, result: Dict[str, object]) -> None:
    rows = []
    for mode, by_prompt in result.items():
        for name, r in by_prompt.items():
            rows.append([mode, name, r["prompt_tokens"], r["plain_tok_s"], r["speculative_tok_s"], f"{r['ratio']:.2f}x",
                         f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}", f"{r['acceptance_rate']:.0%}", f"{r['tokens_per_step']:.2f}",
                         "yes" if r["identical_to_plain"] else f"NO (at {r['first_difference']})"])  # fmt: skip
    table(title, ["decode", "prompt", "prompt tok", "plain tok/s", "spec tok/s", "ratio", "range", "accepted", "tok/step",
                  "same tokens"], rows)  # fmt: skip


# --------------------------------------------------------------------------- serve


def serve_prompts(tokenizer: Tokenizer, n: int) -> List[List[int]]:
    """``n`` copy-heavy prompts: passage i mod 4, repeated from its start by 6, 8, 10... tokens."""
    return [copy_prompt(tokenizer, PASSAGES[i % len(PASSAGES)], 6 + 2 * (i // len(PASSAGES))) for i in range(n)]


def serve_once(engine: Engine, prompts: List[List[int]], max_tokens: int) -> Dict[str, object]:
    """Every prompt submitted at once, then steps until none runs: tokens/s from the first submit to the
    last step, each request's tokens, and the decode-only steps (every running row decoding, the queue
    empty) by batch size (rounded up to a power of two, as ``SpeculationPolicy`` does) and kind: plain,
    or speculative (a verify pass counted in ``engine.speculation.stats``)."""
    tokens: List[List[int]] = [[] for _ in prompts]
    spec = engine.speculation
    before = snapshot(spec.stats) if spec is not None else None
    steps_before = engine.steps
    by_bucket: Dict[str, Dict[str, int]] = {}
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, RequestSettings(max_tokens=max_tokens, ignore_eos=True),
                      lambda event, i=i: tokens[i].append(event.token) if isinstance(event, TokenEvent) else None)  # fmt: skip
    while True:
        running = len(engine.running)  # driven from this thread alone: nothing changes between here and step()
        decode_only = running > 0 and not engine.queue and all(r.next_token is not None for r in engine.running)
        passes = spec.stats.steps if spec is not None else 0
        if not engine.step():
            break
        if decode_only:
            kind = "speculative" if spec is not None and spec.stats.steps > passes else "plain"
            by_bucket.setdefault(f"{bucket(running)} rows", {"plain": 0, "speculative": 0})[kind] += 1
    wall = time.perf_counter() - started
    out = {"tok_s": sum(map(len, tokens)) / wall, "wall_s": wall, "tokens": tokens, "engine_steps": engine.steps - steps_before,
           "by_bucket": by_bucket, "decode_steps_plain": sum(c["plain"] for c in by_bucket.values()),
           "decode_steps_speculative": sum(c["speculative"] for c in by_bucket.values())}  # fmt: skip
    if spec is not None:
        out["stats"] = stats_since(spec.stats, before)
    return out


def serve_part(model: Transformer, tokenizer: Tokenizer, config: dict, rounds: int) -> Dict[str, object]:
    out: Dict[str, object] = {}
    variants = ("plain", "policy", "forced")
    for mode in config["serve_modes"]:
        for rows in config["serve_rows"]:
            prompts = serve_prompts(tokenizer, rows)
            engines = {}
            for variant in variants:
                draft = None if variant == "plain" else "ngram"
                engine = Engine(model, tokenizer, rows, decode=mode, draft=draft, prefix_reuse=False)
                if variant == "forced":
                    engine.policy.wanted = lambda rows: True
                started = time.perf_counter()
                engine.warm_up()
                serve_once(engine, prompts, config["serve_tokens"])  # warm-up: steps built, the policy's first measurements
                log(f"  serve {mode} {rows} rows {variant}: ready in {time.perf_counter() - started:.1f} s")
                engines[variant] = engine
            runs: Dict[str, List[Dict]] = {v: [] for v in variants}
            for round_ in range(rounds):
                for variant in alternate(round_, variants):
                    runs[variant].append(serve_once(engines[variant], prompts, config["serve_tokens"]))
            plain_tokens = runs["plain"][0]["tokens"]
            result: Dict[str, object] = {"requests": rows, "new_tokens": config["serve_tokens"],
                                         "prompt_tokens": [len(p) for p in prompts]}  # fmt: skip
            for variant in variants:
                r = runs[variant]
                plain_steps = sum(x["decode_steps_plain"] for x in r)
                spec_steps = sum(x["decode_steps_speculative"] for x in r)
                buckets: Dict[str, Dict[str, int]] = {}
                for x in r:
                    for b, counts in x["by_bucket"].items():
                        for kind, n in counts.items():
                            buckets.setdefault(b, {"plain": 0, "speculative": 0})[kind] += n
                row: Dict[str, object] = {
                    "tok_s": round(median([x["tok_s"] for x in r]), 2), "engine_steps": round(median([x["engine_steps"] for x in r]), 1),
                    "decode_steps_plain": plain_steps, "decode_steps_speculative": spec_steps,  # over every timed round
                    "speculative_share": round(spec_steps / max(1, plain_steps + spec_steps), 4),
                    "by_bucket": dict(sorted(buckets.items(), key=lambda item: -int(item[0].split()[0]))),
                }  # fmt: skip
                if variant != "plain":
                    ratios = [x["tok_s"] / p["tok_s"] for x, p in zip(r, runs["plain"])]
                    stats = SpeculativeStats()
                    for x in r:
                        stats.add(x["stats"])
                    diffs = [first_difference(a, b) for x in r for a, b in zip(plain_tokens, x["tokens"])]
                    wrong = [d for d in diffs if d is not None]
                    row.update(
                        ratio_to_plain=round(median(ratios), 4), ratio_min=round(min(ratios), 4), ratio_max=round(max(ratios), 4),
                        **stats_dict(stats), identical_to_plain=not wrong, first_difference=min(wrong) if wrong else None,
                        policy=finite(engines[variant].policy.describe()) if variant == "policy" else None,
                        engine_stats=finite(engines[variant].stats()),
                    )  # fmt: skip
                result[variant] = row
            out[f"{mode}/{rows}"] = result
            log(f"  serve {mode} {rows} rows: " + ", ".join(f"{v} {result[v]['tok_s']:.0f} tok/s" for v in variants))
    return out


def print_serve(result: Dict[str, object]) -> None:
    rows = []
    for key, r in result.items():
        mode, requests = key.split("/")
        for variant in ("plain", "policy", "forced"):
            v = r[variant]
            steps = [f"{v['decode_steps_speculative']}/{v['decode_steps_plain'] + v['decode_steps_speculative']}",
                     " ".join(f"{b.split()[0]}:{c['speculative']}/{c['plain'] + c['speculative']}" for b, c in v["by_bucket"].items())]
            if variant == "plain":
                rows.append([mode, requests, variant, v["tok_s"], "1.00x", "", *steps, "", "", ""])
                continue
            rows.append([mode, requests, variant, v["tok_s"], f"{v['ratio_to_plain']:.2f}x", f"{v['ratio_min']:.2f}-{v['ratio_max']:.2f}",
                         *steps, f"{v['acceptance_rate']:.0%}", f"{v['tokens_per_step']:.2f}",
                         "yes" if v["identical_to_plain"] else f"NO (at {v['first_difference']})"])  # fmt: skip
    table("serve: the engine, tiny-mixtral, copy-heavy requests all at once (tokens/s from the first submit to the end)",
          ["decode", "requests", "engine", "tok/s", "vs plain", "range", "spec/decode steps", "by batch (bucket:spec/all)",
           "accepted", "tok/step", "same tokens"], rows)  # fmt: skip
    for key, r in result.items():
        policy = r["policy"]["policy"]
        if policy:
            def ms(seconds):
                return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"

            described = "; ".join(f"{b}: plain {ms(m['plain_s'])}, speculative {ms(m['speculative_s'])}, "
                                  f"gain {'-' if m['gain'] is None else format(m['gain'], '.2f')}"
                                  for b, m in policy.items())  # fmt: skip
            print(f"  policy (its own measurements) {key}: {described}")


# --------------------------------------------------------------------------- main


def print_verify_cost(part: Dict[str, object], prompt_len: int) -> None:
    rows = []
    for label, r in part.items():
        for k, v in r["k"].items():
            rows.append([label, k, v["one_token_ms"], v["k_plus_1_ms"], f"{v['ratio']:.3f}", f"{v['ratio_min']:.3f}-{v['ratio_max']:.3f}",
                         f"{v['best_speedup']:.2f}x"])  # fmt: skip
    table(f"verify-cost: one pass over k + 1 tokens against one token, batch 1, after {prompt_len} tokens "
          "(ratio: the tokens a pass must gain to break even; every guess accepted: (k + 1) / ratio)",
          ["model", "k", "1 token ms", "k+1 tokens ms", "ratio", "range", "all accepted"], rows)  # fmt: skip


def run_part(name: str, options, config: dict, rounds: int, tokenizer: Tokenizer, shared: Dict[str, Transformer]) -> Dict[str, object]:
    """One part's results (and its table printed)."""
    if name == "verify-cost":
        part: Dict[str, object] = {}
        for kind in config["verify_models"]:
            label = kind.replace("wide", config["wide"], 1) if kind.startswith("wide") else kind  # mistral-wide-bf16
            log(f"verify-cost: {label}")
            model = verify_model(kind, config)
            wide = config["wide"] + (f" ({config['wide_layers']} layers)" if config["wide_layers"] else "")
            part[label] = {"model": "tiny-mixtral" if kind == "tiny-mixtral" else wide, "dtype": str(model.dtype),
                           "weights": "int8" if kind.endswith("int8") else str(model.dtype).replace("torch.", ""),
                           **verify_cost(model, config["ks"], rounds, config["prompt_len"], config["call_s"])}  # fmt: skip
            del model
            gc.collect()  # the next model is built beside nothing
        print_verify_cost(part, config["prompt_len"])
        return part
    if "tiny-mixtral" not in shared:
        shared["tiny-mixtral"] = shipped("tiny-mixtral")
    model = shared["tiny-mixtral"]
    if name == "ngram":
        log("ngram: tiny-mixtral, prompt lookup")
        prompts = {f"passage{i}": copy_prompt(tokenizer, PASSAGES[i]) for i in range(config["passages"])}
        part = speculative_vs_plain(model, prompts, ("eager", "static"), config["ngram_tokens"], rounds, PromptLookup, k=4)
        print_generate("ngram: prompt lookup (k = 4), tiny-mixtral float32, batch 1, copy-heavy prompts, greedy", part)
        return part
    if name == "draft":
        log("draft: tiny-mixtral with tiny-mistral drafting")
        draft = DraftModel(shipped("tiny-mistral"))
        prompts = {f"verse{i}": tokenizer.encode(HELD_OUT[i], bos=True) for i in range(config["held_out"])}
        part = speculative_vs_plain(model, prompts, ("eager", "static"), config["draft_tokens"], rounds, lambda: draft, k=4)
        print_generate("draft: tiny-mistral drafting for tiny-mixtral (adaptive k <= 4), float32, batch 1, held-out verses, greedy",
                       part)  # fmt: skip
        return part
    log("serve: the engine with draft='ngram'")
    part = serve_part(model, tokenizer, config, rounds)
    print_serve(part)
    return part


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per comparison (default 5; --quick 1)")
    parser.add_argument("--out", type=Path, default=None, help="the results' JSON (e.g. bench/results_speculative.json)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round: a smoke test")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    config = dict(QUICK if options.quick else FULL)
    rounds = options.rounds or config["rounds"]
    results: Dict[str, object] = {
        "machine": machine(), "quick": options.quick, "rounds": rounds,
        "settings": {key: value for key, value in config.items() if key != "rounds"}, "parts": {}, "part_wall_s": {},
        "disturbed": {},
    }  # fmt: skip

    def save() -> None:
        if options.out is not None:
            options.out.write_text(json.dumps(finite(results), indent=1) + "\n")

    started = time.perf_counter()
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    shared: Dict[str, Transformer] = {}
    with torch.inference_mode():
        for name in [part for part in PARTS if part in options.parts]:
            part_started = time.perf_counter()
            watcher = CpuWatcher().start()  # other processes on the CPU: they slow both sides and stall 2-thread runs
            results["parts"][name] = run_part(name, options, config, rounds, tokenizer, shared)
            busy = results["disturbed"][name] = watcher.stop()
            results["part_wall_s"][name] = round(time.perf_counter() - part_started, 1)
            if busy["busy_samples"]:
                print(f"  (other processes used the CPU in {busy['busy_samples']} of {busy['samples']} samples: "
                      f"{', '.join(list(busy['offenders'])[:3])})")  # fmt: skip
            save()
    results["wall_s"] = round(time.perf_counter() - started, 1)
    save()
    print(f"\n{results['wall_s']:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in results['part_wall_s'].items())})"
          + (f"; results in {options.out}" if options.out else ""))  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MIXTRAL_INFER_MEASURE", "0")  # the same choices in every run: Tuning()'s defaults
    sys.exit(main())
