"""Ministral's alternating layers on a CPU (issue 71): decode and prefill tokens/s of ``ministral-wide``
(Ministral 8B's widths, 4 layers: one full-attention layer, three with a window of 4096), ours eager and
compiled beside llama.cpp, bfloat16, batch 1, the runs alternating; see README.md and docs/performance.md.

    .venv/bin/python bench/llamacpp/make_models.py --models ministral-wide --types bf16
    .venv/bin/python bench/llamacpp/run_ministral.py --rounds 3 --out bench/llamacpp/results_<machine>_ministral.json

This llama.cpp (llama-cpp-python 0.3.36's) does not convert MinistralForCausalLM, and its LLAMA
architecture (what Mistral converts to) has no sliding window; make_models.py writes the same weights as
two GGUF files it runs (its docstring says how): ``llama_iswa``, llama.cpp's GRANITE_SWA architecture
with every Granite multiplier at 1 (the same computation as Ministral's, per-layer windows from
``layer_types``, an iSWA cache), and ``llama_allfull``, LLAMA (every layer full attention, as llama.cpp
runs Mistral). The run records what the converter says to the MinistralForCausalLM folder itself.

Per round, each after run_compare.py's wait for a quiet machine (a disturbed run repeated): llama-bench
``-t 2 -p 8192 -n 128 -r 1 --no-warmup`` on each GGUF (one timed run of each test, the prompt first: its
warm-up would be a second 8192-token prompt, 100 s here); ours, one process
for the eager loop (``model(tokens, [1], cache).argmax(-1)`` per token, 128 tokens after a 64-token
prompt, after a 16-token warm-up; then one 8192-token prompt in the default 2048-token chunks, into a cache
of 8192 + 129 slots for the full layer, after a 2048-token warm-up) and one for the compiled decode
(``generate(decode="compiled")``, 127 tokens timed from the first new token to the last, after a warm-up
call that compiles). Unless ``--no-depth``, llama.cpp's GRANITE_SWA file and our eager loop also decode
128 tokens after the 8192-token prompt (llama-bench ``-p 0 -n 128 -d 8192``; ours from the timed prompt's
cache), where the windowed layers read 4096 cached positions and the full one 8192 (not the all-full
file: another 8192-token prompt a round).

Our side runs in a child process of this script (``--ours FOLDER``), so that each run loads afresh.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import run_compare as rc  # noqa: E402  (the quiet-machine wait, bandwidth, llama-bench's binary)

NAME = "ministral-wide"
PREFILL = 8192
NEW_TOKENS = 128
SYSTEMS = {
    "llama_iswa": "llama.cpp, GRANITE_SWA (Ministral's windows)",
    "llama_allfull": "llama.cpp, LLAMA (all layers full)",
    "ours": "ours, eager loop",
    "ours_compiled": "ours, compiled",
}


# --------------------------------------------------------------------------- our side (child process)


def ours_child(folder: str, decode: str, depth: bool) -> dict:
    import torch

    import bench_vs_transformers as b
    from bench_decode_modes import decode_seconds

    from mixtral_infer import load_model
    from mixtral_infer.generation.generate import default_chunk_size
    from mixtral_infer.generation.generate import prefill as ours_prefill

    start = time.perf_counter()
    pack = "columns" if decode == "compiled" else True  # as the CLI loads for each --decode (bench/ours_run.py)
    model = load_model(folder, max_batch_size=1, device="cpu", dtype=torch.bfloat16, pack=pack)
    out = {"dtype": "bfloat16", "decode": decode, "load_s": time.perf_counter() - start, "threads": torch.get_num_threads(),
           "packed": pack, "windows": model.args.layer_windows, "decode_bytes_b1": b.decode_bytes(model, 1)["bytes"]}  # fmt: skip
    vocab = model.args.vocab_size
    prompts = b.random_prompts(1, b.PROMPT_LEN, vocab, seed=1001)
    with torch.inference_mode():
        if decode == "loop":
            b.ours_decode(model, prompts, 16)  # warm-up
            out["decode_s"], _ = b.ours_decode(model, prompts, NEW_TOKENS)
            out["decode_tok_s"] = NEW_TOKENS / out["decode_s"]
            prompt = b.random_prompts(1, PREFILL, vocab, seed=7)[0]
            chunk = default_chunk_size(1)
            cache = model.make_cache(1, max_seqlen=PREFILL + NEW_TOKENS + 1)
            cache.start_sequences(1)
            ours_prefill(model, cache, [prompt[:chunk]], chunk)  # warm-up: one chunk
            del cache
            cache = model.make_cache(1, max_seqlen=PREFILL + NEW_TOKENS + 1)
            cache.start_sequences(1)
            out["cache_slots"] = list(cache.layer_sizes)
            start = time.perf_counter()
            logits = ours_prefill(model, cache, [prompt], chunk)
            out["prefill_s"] = time.perf_counter() - start
            out["prefill_tok_s"] = PREFILL / out["prefill_s"]
            out["prefill_chunk"] = chunk
            if depth:
                tokens = logits.argmax(-1)
                start = time.perf_counter()
                for _ in range(NEW_TOKENS):
                    tokens = model(tokens, [1], cache).argmax(-1)
                out["depth_decode_s"] = time.perf_counter() - start
                out["depth_decode_tok_s"] = NEW_TOKENS / out["depth_decode_s"]
        else:
            start = time.perf_counter()
            decode_seconds(model, prompts, decode, NEW_TOKENS)  # warm-up (compiles)
            out["compile_s"] = time.perf_counter() - start
            out["decode_s"] = decode_seconds(model, prompts, decode, NEW_TOKENS)
            out["decode_tok_s"] = (NEW_TOKENS - 1) / out["decode_s"]
    return out


def ours_run(folder: Path, decode: str, depth: bool) -> dict:
    cmd = [sys.executable, __file__, "--ours", str(folder), "--decode", decode] + ([] if depth else ["--no-depth"])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- llama.cpp


def llama_bench(gguf: Path, args: list) -> list:
    cmd = [str(rc.LLAMA / "build/bin/llama-bench"), "-m", str(gguf), "-t", "2", *args, "-r", "1", "--no-warmup", "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return cmd, json.loads(p.stdout)


def llama_run(gguf: Path, depth: bool) -> dict:
    cmd, rows = llama_bench(gguf, ["-p", str(PREFILL), "-n", str(NEW_TOKENS)])
    out = {"cmd": " ".join(cmd)}
    if depth:
        depth_cmd, depth_rows = llama_bench(gguf, ["-p", "0", "-n", str(NEW_TOKENS), "-d", str(PREFILL)])
        out["depth_cmd"] = " ".join(depth_cmd)
        rows += [dict(r, depth=True) for r in depth_rows]
    for row in rows:
        key = "depth_decode" if row.get("depth") else "prefill" if row["n_prompt"] else "decode"
        out[key + "_tok_s"] = row["avg_ts"]
    first = rows[0]
    out.update(build=(first.get("build_commit"), first.get("build_number")), cpu_info=first.get("cpu_info"),
               flash_attn=first.get("flash_attn"), type_k=first.get("type_k"), n_batch=first.get("n_batch"),
               n_ubatch=first.get("n_ubatch"), model_type=first.get("model_type"))  # fmt: skip
    return out


def converter_verdict(hf_dir: Path) -> str:
    """What llama.cpp's convert_hf_to_gguf.py says to the MinistralForCausalLM folder (its last line)."""
    env = {"PYTHONPATH": str(rc.LLAMA / "gguf-py"), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(rc.LLAMA / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "bf16",
           "--outfile", "/tmp/ministral-refused.gguf"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in (p.stderr + p.stdout).splitlines() if line.strip()]
    return f"exit {p.returncode}: {lines[-1] if lines else ''}"


def gguf_facts(path: Path) -> dict:
    """The GGUF's architecture and attention keys (what llama.cpp will run)."""
    sys.path.insert(0, str(rc.LLAMA / "gguf-py"))
    import gguf

    r = gguf.GGUFReader(str(path))
    facts = {}
    for f in r.fields.values():
        if f.name == "general.architecture":
            facts["architecture"] = bytes(f.parts[-1]).decode()
        elif any(k in f.name for k in ("sliding_window", "block_count", "rope.freq_base", "attention.scale", "logit_scale",
                                       "embedding_scale", "residual_scale", "context_length")):  # fmt: skip
            values = [x for i in f.data for x in f.parts[i].tolist()]
            facts[f.name.split(".", 1)[1]] = values if len(values) > 1 else values[0]
    facts["sinks"] = sorted({float(t.data.max()) for t in r.tensors if t.name.endswith("attn_sinks.weight")})
    return facts


# --------------------------------------------------------------------------- the stand-in, checked


def check_stand_in(work: Path, n_ctx: int = 64, window: int = 8) -> dict:
    """Does llama.cpp's GRANITE_SWA stand-in compute Ministral's model? A small one (dim 128, 4 layers,
    windows [full, 8, 8, 8], vocab 2000 = the tokenizer's), float32 GGUF files made as make_models.py
    makes them, and llama-perplexity's PPL (chunks of ``n_ctx`` tokens, the second half of each scored)
    beside ours over the same tokens (read back from its --kl-divergence-base file), windowed and with
    every layer full. Needs ``cmake --build build --target llama-perplexity``."""
    import dataclasses
    import math
    import shutil

    import numpy as np
    import torch

    import bench_vs_transformers as b
    import make_models

    from mixtral_infer import load_model

    work.mkdir(parents=True, exist_ok=True)
    args = dataclasses.replace(b.bench_args(NAME, max_batch_size=1), dim=128, head_dim=32, hidden_dim=256, n_heads=4, n_kv_heads=2,
                               vocab_size=2000, sliding_window=[None, window, window, window])  # fmt: skip
    hf_dir = work / "tiny-hf"
    if not (hf_dir / "config.json").is_file():
        b.hf_model(args).save_pretrained(hf_dir, safe_serialization=True)
        shutil.copy(make_models.MAIN / "mixtral_infer/shipped/tiny-mixtral/tokenizer.model", hf_dir / "tokenizer.model")
    folders = make_models.llama_folders(hf_dir, work, "tiny")
    config = json.loads((hf_dir / "config.json").read_text())
    full_dir = work / "tiny-full-ours"  # ours with every layer full: the same weights, no window
    make_models._linked(hf_dir, full_dir, dict({k: v for k, v in config.items() if k != "layer_types"},
                                               architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None))  # fmt: skip
    text = work / "text.txt"
    text.write_text((make_models.MAIN / "README.md").read_text()[:6000])
    env = {"PYTHONPATH": str(rc.LLAMA / "gguf-py"), "PATH": "/usr/bin:/bin"}
    llama = {}
    tokens = None
    for key, folder in folders.items():
        gguf = work / f"{key}-f32.gguf"
        if not gguf.is_file():
            subprocess.run([sys.executable, str(rc.LLAMA / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
                            "--outfile", str(gguf)], check=True, env=env, capture_output=True)  # fmt: skip
        base = work / f"{key}.kld"
        p = subprocess.run([str(rc.LLAMA / "build/bin/llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(n_ctx),
                            "-b", str(n_ctx), "-t", "2", "--kl-divergence-base", str(base)],
                           capture_output=True, text=True, check=True)  # fmt: skip
        final = [line for line in (p.stdout + p.stderr).splitlines() if "Final estimate: PPL" in line]
        llama["llama_iswa" if key == "tiny" else "llama_allfull"] = float(final[-1].split("=")[1].split()[0])
        raw = base.read_bytes()
        ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
        tokens = np.frombuffer(raw, np.int32, n_chunk * ctx, 20).reshape(n_chunk, ctx).tolist()
    ours = {}
    for key, folder in (("ours", hf_dir), ("ours_allfull", full_dir)):
        model = load_model(folder, max_batch_size=1, device="cpu", dtype=torch.float32)
        nll, count = 0.0, 0
        with torch.inference_mode():
            for chunk in tokens:
                chunk = [1] + chunk[1:]  # llama-perplexity puts BOS first in every chunk
                cache = model.make_cache(1, max_seqlen=n_ctx)
                cache.start_sequences(1)
                logp = torch.log_softmax(model(torch.tensor(chunk), [n_ctx], cache).float(), -1)
                first = n_ctx // 2
                nll -= sum(logp[j, chunk[j + 1]].item() for j in range(first, n_ctx - 1))
                count += n_ctx - 1 - first
        ours[key] = math.exp(nll / count)
    return {"shape": "dim 128, head_dim 32, 4 heads, 2 KV heads, hidden 256, vocab 2000, windows [full, 8, 8, 8], float32",
            "perplexity_ctx": n_ctx, "chunks": len(tokens), "ppl": {**llama, **ours}}  # fmt: skip


# --------------------------------------------------------------------------- the run


def summarize(runs: list, nbytes: int | None) -> dict:
    out = {}
    for key in ("decode_tok_s", "prefill_tok_s", "depth_decode_tok_s"):
        values = [r[key] for r in runs if r.get(key)]
        if values:
            out[key] = statistics.median(values)
            out[key.replace("_tok_s", "_runs")] = [round(v, 2) for v in values]
    if nbytes and out.get("decode_tok_s"):
        out["bytes_b1"] = nbytes
        out["ceiling_fraction"] = statistics.median(r["decode_tok_s"] / (max(r["bw_gb_s"]) * 1e9 / nbytes) for r in runs if r.get("decode_tok_s"))
    return out


def print_table(result: dict) -> None:
    print(f"{'system':48s} {'decode b1':>10s} {'prefill 8192':>13s} {'decode @8192':>13s}  runs")
    for system, label in SYSTEMS.items():
        s = result["summary"].get(system)
        if not s:
            continue
        cells = [f"{s[k]:>{w}.{p}f}" if s.get(k) else f"{'-':>{w}s}" for k, w, p in
                 (("decode_tok_s", 10, 2), ("prefill_tok_s", 13, 1), ("depth_decode_tok_s", 13, 2))]  # fmt: skip
        runs = ", ".join(f"{k.split('_runs')[0]} {s[k]}" for k in ("decode_runs", "prefill_runs", "depth_decode_runs") if k in s)
        print(f"{label:48s} {' '.join(cells)}  {runs}")


def plot(result: dict, out: Path) -> None:
    try:
        import plots
    except ImportError as error:
        print(f"no plot: {error}", file=sys.stderr)
        return
    try:
        plt = plots._pyplot()
        summary = result["summary"]
        panels = [("decode, batch 1, 128 tokens", [("after 64 tokens", "decode"), ("after 8192 tokens", "depth_decode")]),
                  ("prefill, one 8192-token prompt", [("", "prefill")])]  # fmt: skip
        fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.8), gridspec_kw={"width_ratios": [2, 1]})
        colors = {"llama_iswa": "#ff7f0e", "llama_allfull": "#fdd0a2", "ours": "#9ecae1", "ours_compiled": "#1f77b4"}
        for ax, (title, groups) in zip(axes, panels):
            series = {s: [summary.get(s, {}).get(k + "_tok_s") for _, k in groups] for s in SYSTEMS}
            spread = {s: [summary.get(s, {}).get(k + "_runs") for _, k in groups] for s in SYSTEMS}
            plots._bars(ax, [g for g, _ in groups], series, colors, spread, fmt="{:.1f}")
            ax.set_title(title, fontsize=9.5)
            ax.set_ylabel("tokens/s")
        handles, names = axes[0].get_legend_handles_labels()
        fig.legend(handles, [SYSTEMS[n] for n in names], fontsize=8, loc="lower center", ncol=2, frameon=False,
                   bbox_to_anchor=(0.5, 0.06))  # fmt: skip
        fig.subplots_adjust(bottom=0.3)
        machine = plots._join(result["machine"].get("cpu"), "2 threads", f"torch {result['versions']['torch']}",
                              f"llama.cpp {result['versions']['llama_cpp'][0]}")  # fmt: skip
        note = (f"ministral-wide (Ministral 8B's widths, 4 layers: full, then 3 windowed of 4096), bfloat16, median of "
                f"{result['rounds']} alternating rounds, bars the slowest and fastest (bench/llamacpp/run_ministral.py, {out.name})")  # fmt: skip
        title = "Ministral's alternating layers on a CPU: tokens/s\n" + machine
        fig.suptitle(title, fontsize=11)
        fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=7.5, color="#444444", wrap=True)
        fig.tight_layout(rect=(0, 0.16, 1, 1))
        fig.savefig(out.with_suffix(".png"), dpi=110)
        plt.close(fig)
        print(f"plot: {out.with_suffix('.png')}", file=sys.stderr)
    except Exception as error:  # the figures are written already
        print(f"no plot: {type(error).__name__}: {error}", file=sys.stderr)


def machine() -> dict:
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    cpu = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")).split(":", 1)[1]
    return {"cpu": cpu.strip(), "cores": len(__import__("os").sched_getaffinity(0)),
            "simd": sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--quiet", type=float, default=0.1, help="max cores used by other processes before a run")
    ap.add_argument("--no-depth", dest="depth", action="store_false", help="skip the decode after an 8192-token prompt")
    ap.add_argument("--out", type=Path, default=HERE / "results_ministral.json")
    ap.add_argument("--check-only", action="store_true", help="only check the GRANITE_SWA stand-in on a small model")
    ap.add_argument("--ours", help=argparse.SUPPRESS)  # the child process: one run of ours on this folder
    ap.add_argument("--decode", default="loop", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.ours:
        print(json.dumps(ours_child(a.ours, a.decode, a.depth)))
        return
    if a.check_only:
        print(json.dumps(check_stand_in(rc.MODELS / "check"), indent=1))
        return
    import torch

    rc.LOG = open(a.out.with_suffix(".log"), "a")
    ggufs = {"llama_iswa": rc.MODELS / f"{NAME}-bf16.gguf", "llama_allfull": rc.MODELS / f"{NAME}-allfull-bf16.gguf"}
    result = {
        "what": "issue 71: Ministral's alternating layers, decode and prefill tokens/s at batch 1 on CPU, bfloat16",
        "model": NAME, "prefill_tokens": PREFILL, "new_tokens": NEW_TOKENS, "prompt_tokens": 64, "rounds": a.rounds,
        "machine": machine(), "versions": {"torch": torch.__version__},
        "converter_on_MinistralForCausalLM": converter_verdict(rc.MODELS / f"{NAME}-hf"),
        "stand_in_check": check_stand_in(rc.MODELS / "check"),
        "gguf": {s: gguf_facts(p) for s, p in ggufs.items() if s in a.systems},
        "runs": {s: [] for s in a.systems}, "summary": {},
    }  # fmt: skip
    rc.log(f"converter on MinistralForCausalLM: {result['converter_on_MinistralForCausalLM']}")
    rc.log(f"GGUF: {result['gguf']}")
    nbytes = {s: rc.gguf_decode_bytes(p) for s, p in ggufs.items() if s in a.systems}
    started = time.time()
    for r in range(a.rounds):
        rc.log(f"== round {r + 1}/{a.rounds} ({(time.time() - started) / 60:.1f} min so far)")
        for system in a.systems:
            if system in ggufs:
                depth = a.depth and system == "llama_iswa"  # the all-full file: no decode after 8192 (time)
                run = rc.timed(system, lambda: llama_run(ggufs[system], depth), a.quiet)
            else:
                decode = "loop" if system == "ours" else "compiled"
                run = rc.timed(system, lambda: ours_run(rc.MODELS / f"{NAME}-hf-notok", decode, a.depth), a.quiet)
            result["runs"][system].append(run)
            result["summary"][system] = summarize(result["runs"][system], nbytes.get(system) or run.get("decode_bytes_b1"))
            result["wall_min"] = round((time.time() - started) / 60, 1)
            llama = next((x for s in ("llama_iswa", "llama_allfull") for x in result["runs"].get(s, [])), None)
            if llama:
                result["versions"]["llama_cpp"] = llama["build"]
                result["machine"]["llama_cpu_info"] = llama["cpu_info"]
            a.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    plot(result, a.out)


if __name__ == "__main__":
    main()
