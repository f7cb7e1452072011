"""Alternate llama.cpp (llama-bench) and mixtral_infer runs on the same model shapes; see README.md.

Usage: python bench/llamacpp/run_compare.py [--rounds 3] [--models mixtral-bench mistral-bench]
       [--dtypes f32 bf16 q8_0 q4_0] [--out bench/llamacpp/results.json]

Pairs (llama.cpp GGUF type -> ours): f32 -> float32, bf16 -> bfloat16, q8_0 -> bfloat16 with
``--quantize int8`` (per-row scales; Q8_0 has one per 32 weights; ``--q8-0-as w8a8`` for int8
activations too, as Q8_0 multiplies), q4_0 -> ``--quantize int4``
(groups of 32, as Q4_0; ``--q4-0-as nf4`` for NF4, groups of 64, bitsandbytes' kernel). Our side runs ``bench/ours_run.py`` (the current API).

Per (model, dtype) and round: wait until other processes use < --quiet cores (10 s, /proc/stat), log
/proc/loadavg and `top -bn1 | head -15`; read bandwidth; run A = llama-bench; read bandwidth;
wait/log again; run B = bench/ours_run.py; read bandwidth. A run during which other processes used
> 0.05 core on average, or one of them > 0.2 core in a 2 s sample, is discarded and repeated (<= 5x).
Ceiling: bytes one batch-1 decode step reads (llama.cpp: from the GGUF's tensor sizes; ours:
bench.decode_bytes) / bandwidth (the higher of the readings just before and after the run).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import bench_vs_transformers as b  # noqa: E402

LLAMA = Path(os.environ.get("LLAMA_WORK", "/tmp/llama")) / "llama_cpp_python-0.3.36/vendor/llama.cpp"
MODELS = Path(os.environ.get("LLAMA_WORK", "/tmp/llama")) / "models"
PY = sys.executable
LOG = None


def log(msg):
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, file=sys.stderr, flush=True)
    LOG.write(line + "\n")
    LOG.flush()


def cpu_ticks():
    """(busy seconds of all CPUs from /proc/stat, CPU seconds of this process + its reaped children)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (sum(f[:7]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")  # user..softirq but idle, iowait (no steal)
    me, kids = os.times()[:2], os.times()[2:4]
    return busy, sum(me) + sum(kids)


def other_cores(t0, c0):
    """Average cores used by everything outside this process tree since (t0, cpu_ticks())."""
    busy, own = cpu_ticks()
    return max(0.0, (busy - c0[0]) - (own - c0[1])) / (time.time() - t0)


def other_cpu(seconds=10.0):
    """Cores used by other processes over `seconds` (from /proc/stat, so short-lived ones count too)."""
    t0, c0 = time.time(), cpu_ticks()
    w = b.CpuWatcher()
    before = w._snapshot()
    time.sleep(seconds)
    busy = other_cores(t0, c0)
    after = w._snapshot()
    hz = os.sysconf("SC_CLK_TCK")
    top = sorted(((round((t - before[p][1]) / hz / seconds, 2), c[:80]) for p, (_, t, c) in after.items()
                  if p in before and p != os.getpid() and t - before[p][1] > 0.05 * hz * seconds), reverse=True)
    return busy, top


def wait_quiet(limit, max_wait=900):
    start = time.time()
    while True:
        load = Path("/proc/loadavg").read_text().strip()
        top = subprocess.run("top -bn1 | head -15", shell=True, capture_output=True, text=True).stdout
        busy, offenders = other_cpu()
        LOG.write(top)
        log(f"loadavg {load}; other processes {busy:.2f} cores {offenders[:3]}")
        if busy < limit or time.time() - start > max_wait:
            return {"loadavg": load, "other_cores": round(busy, 2), "offenders": offenders[:3],
                    "waited_s": round(time.time() - start), "quiet": busy < limit}
        time.sleep(30)


def bandwidth():
    return b.read_bandwidth(1.5, repeats=5) / 1e9


def gguf_decode_bytes(path):
    """Bytes of weights one batch-1 decode step reads, from the GGUF's tensors."""
    sys.path.insert(0, str(LLAMA / "gguf-py"))
    import gguf

    r = gguf.GGUFReader(str(path))
    n_exp = n_used = None
    for f in r.fields.values():
        if f.name.endswith(".expert_count"):
            n_exp = int(f.parts[-1][0])
        if f.name.endswith(".expert_used_count"):
            n_used = int(f.parts[-1][0])
    total = 0
    for t in r.tensors:
        nb = int(t.n_bytes)
        if t.name == "token_embd.weight":
            total += nb // int(t.shape[-1])  # one row (shape is ggml order: ne0=dim, ne1=vocab)
        elif "_exps" in t.name:
            total += nb * n_used // n_exp
        else:
            total += nb
    return total


def llama_bench(gguf_path, what, extra=()):
    cmd = [str(LLAMA / "build/bin/llama-bench"), "-m", str(gguf_path), "-t", "2", "-p", "2048" if "prefill" in what else "0",
           "-n", "128" if "decode" in what else "0", "-r", "3", "-o", "json", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(p.stdout)
    out = {"cmd": " ".join(cmd)}
    for row in rows:
        key = "prefill" if row["n_prompt"] else "decode"
        out[key + "_tok_s"] = row["avg_ts"]
        out[key + "_samples_tok_s"] = row["samples_ts"]
    out["build"] = rows[0].get("build_commit"), rows[0].get("build_number")
    out["flash_attn"], out["type_k"], out["n_batch"], out["n_ubatch"] = (
        rows[0].get("flash_attn"), rows[0].get("type_k"), rows[0].get("n_batch"), rows[0].get("n_ubatch"))
    out["cpu_info"] = rows[0].get("cpu_info")
    return out


def llama_run(gguf_path, what=("decode", "prefill")):
    """llama-bench's decode and/or prefill. Where the CPU reports AMX, llama.cpp repacks Q8_0/Q4_0 weights
    for its AMX kernels by default; on an AMX Xeon virtual machine its prompt kernels died at their first tile
    instruction (SIGILL, or SIGSEGV at ``ldtilecfg``) while its decode, which does not use tiles, ran.
    Then decode is measured as llama.cpp runs by default and prefill again with ``--repack 0``."""
    try:
        return llama_bench(gguf_path, what)
    except subprocess.CalledProcessError as e:
        if e.returncode >= 0 or "prefill" not in what:
            raise
        log(f"  llama.cpp died with signal {-e.returncode}; decode as is, prefill with --repack 0")
        out = llama_bench(gguf_path, ["decode"]) if "decode" in what else {}
        prefill = llama_bench(gguf_path, ["prefill"], ["--repack", "0"])
        out.update({k: v for k, v in prefill.items() if k.startswith("prefill") or k not in out})
        out["prefill_cmd"], out["prefill_repack"] = prefill["cmd"], 0
        return out


OURS = {"f32": ["--dtype", "float32"], "bf16": ["--dtype", "bfloat16"],
        "q8_0": ["--dtype", "bfloat16", "--quantize", "int8"], "q4_0": ["--dtype", "bfloat16", "--quantize", "int4"]}


def ours_run(folder, ours_args):
    cmd = [PY, str(HERE.parent / "ours_run.py"), str(folder), *ours_args]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def timed(system, fn, quiet, attempts=5, max_other=0.05):
    """One run; repeated (up to `attempts` times) while another process used the CPU during it."""
    discarded = []
    for attempt in range(attempts):
        cond = wait_quiet(quiet)
        bw0 = bandwidth()
        watcher = b.CpuWatcher(interval=2.0).start()
        t0, c0 = time.time(), cpu_ticks()
        res = fn()
        res["other_cores_during"] = round(other_cores(t0, c0), 3)
        res["wall_s"] = round(time.time() - t0, 1)
        res["disturbed"] = watcher.stop()
        bw1 = bandwidth()
        res.update(system=system, before=cond, bw_gb_s=[round(bw0, 1), round(bw1, 1)])
        busy = res["other_cores_during"] > max_other or res["disturbed"]["busy_samples"] > 0
        offenders = sorted(res["disturbed"]["offenders"].items(), key=lambda kv: -kv[1])[:2]
        log(f"  {system}: decode {res.get('decode_tok_s', 0):.1f} tok/s, prefill {res.get('prefill_tok_s', 0):.0f} "
            f"tok/s, bw {bw0:.1f}/{bw1:.1f} GB/s, other cores during run {res['other_cores_during']:.3f}, "
            f"busy samples {res['disturbed']['busy_samples']}/{res['disturbed']['samples']} {offenders}"
            + (" -> discarded, repeating" if busy and attempt < attempts - 1 else ""))
        if not busy:
            break
        discarded.append({k: res.get(k) for k in ("decode_tok_s", "prefill_tok_s", "other_cores_during", "bw_gb_s")})
    res["discarded_disturbed_runs"] = discarded
    return res


def main():
    global LOG
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=["mixtral-bench", "mistral-bench"])
    ap.add_argument("--dtypes", nargs="+", default=["f32", "bf16", "q8_0"])
    ap.add_argument("--quiet", type=float, default=0.1, help="max cores used by other processes before a run")
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    ap.add_argument("--what", nargs="+", default=["decode", "prefill"], help="llama.cpp and ours: decode, prefill or both")
    ap.add_argument("--ours-decode", nargs="+", default=["loop"], choices=["loop", "compiled"],
                    help="how ours_run.py decodes: loop (eager forward per token) and/or compiled (generate, decode='compiled')")
    ap.add_argument("--q8-0-as", default="int8", choices=["int8", "w8a8"],
                    help="what ours runs beside Q8_0: int8 (weight-only) or w8a8 (int8 activations too, as Q8_0 does)")
    ap.add_argument("--q4-0-as", default="int4", choices=["int4", "nf4"],
                    help="what ours runs beside Q4_0: int4 (groups of 32) or nf4 (quant/nf4.py)")
    a = ap.parse_args()
    OURS["q8_0"] = ["--dtype", "bfloat16", "--quantize", a.q8_0_as]
    OURS["q4_0"] = ["--dtype", "bfloat16", "--quantize", a.q4_0_as]
    LOG = open(a.out.with_suffix(".log"), "a")
    results = json.loads(a.out.read_text()) if a.out.is_file() else {}
    for name in a.models:
        for dt in a.dtypes:
            key = f"{name}/{dt}"
            gguf_path = MODELS / f"{name}-{dt}.gguf"
            if not gguf_path.is_file():
                log(f"== {key}: {gguf_path} not found (make_models.py), skipped")
                continue
            entry = {"llama_bytes_b1": gguf_decode_bytes(gguf_path), "llama": []}
            log(f"== {key}: llama.cpp reads {entry['llama_bytes_b1'] / 1e6:.1f} MB per decode step")
            for r in range(a.rounds):
                entry["llama"].append(timed("llama.cpp", lambda: llama_run(gguf_path, a.what), a.quiet))
                for mode in a.ours_decode:
                    system = ours_system(mode)
                    what = a.what if mode == "loop" else ["decode"]  # prefill does not depend on the decode mode
                    ours_args = OURS[dt] + ["--what", *what, "--decode", mode]
                    entry.setdefault(system, []).append(
                        timed(system, lambda: ours_run(MODELS / f"{name}-hf-notok", ours_args), a.quiet))
            summarize(entry)
            results[key] = entry
            a.out.write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)
    if a.out.is_file():
        from plots import plot_after_run  # bench/plots.py: the plot beside the JSON

        plot_after_run("llamacpp", a.out)


def ours_system(mode):
    return "ours" if mode == "loop" else f"ours_{mode}"


SYSTEMS = ("llama", "ours", "ours_compiled")


def _median(runs, key):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(e):
    for system in SYSTEMS:
        nbytes = e["llama_bytes_b1"] if system == "llama" else None
        runs = e.get(system)
        if not runs:
            continue
        nb = nbytes or runs[0].get("decode_bytes_b1")
        fr = [r["decode_tok_s"] / (max(r["bw_gb_s"]) * 1e9 / nb) for r in runs if nb and r.get("decode_tok_s")]
        e[system + "_summary"] = {
            "decode_tok_s": _median(runs, "decode_tok_s"),
            "prefill_tok_s": _median(runs, "prefill_tok_s"),
            "decode_runs": [round(r.get("decode_tok_s") or 0, 2) for r in runs],
            "prefill_runs": [round(r.get("prefill_tok_s") or 0, 1) for r in runs],
            "bytes_b1": nb,
            "bw_gb_s_median": statistics.median(x for r in runs for x in r["bw_gb_s"]),
            "ceiling_fraction_runs": [round(f, 3) for f in fr],
            "ceiling_fraction": statistics.median(fr) if fr else None,
        }


def _fmt(value, spec):
    return format(value, spec) if value is not None else format("-", ">" + spec.split(".")[0].lstrip(">"))


def print_table(results):
    print(f"{'model/dtype':22s} {'system':13s} {'decode b1':>10s} {'prefill2048':>12s} {'MB/step':>8s} "
          f"{'ceiling%':>8s}  runs")
    for key, e in results.items():
        for system in SYSTEMS:
            s = e.get(system + "_summary")
            if s:
                mb = s["bytes_b1"] / 1e6 if s["bytes_b1"] else None
                print(f"{key:22s} {system:13s} {_fmt(s['decode_tok_s'], '10.1f')} {_fmt(s['prefill_tok_s'], '12.0f')} "
                      f"{_fmt(mb, '8.1f')} {_fmt(s['ceiling_fraction'], '8.0%')}  decode {s['decode_runs']} "
                      f"prefill {s['prefill_runs']} bw~{s['bw_gb_s_median']:.1f}")
        l = e.get("llama_summary")
        for system in SYSTEMS[1:]:
            o = e.get(system + "_summary")
            if o and l:
                ratios = [f"{what} {o[k] / l[k]:.2f}" for what, k in (("decode", "decode_tok_s"), ("prefill", "prefill_tok_s"))
                          if o[k] and l[k]]
                print(f"{'':22s} {system}/llama: {', '.join(ratios)}")


if __name__ == "__main__":
    main()
