"""Issue 76: the same GGUF file loaded and decoded by llama.cpp and by mixtral_infer, alternating.

Usage: python bench/llamacpp/run_gguf.py [--rounds 3] [--model mistral-wide] [--types q8_0 q4_0]
       [--out bench/llamacpp/results_gguf.json] [--max-wait 900]

Files: $LLAMA_WORK/models/{model}-{type}.gguf (make_models.py --models mistral-wide --types f32 q8_0 q4_0).
Per file and round, each step after run_compare.timed's quiet-CPU wait (repeated while another process
used the CPU during it):

load (the file in the page cache: it is read once before the rounds; peak RSS from /usr/bin/time's %M;
  ours also from the child's own VmHWM)
  llama.cpp, mmap (its default, ``--load-mode auto``) and ``--load-mode none`` (this llama.cpp has no
  --no-mmap): ``llama-completion -m F -t 2 -n 1 -p hi -no-cnv``, its printed ``load time``
  (llama_perf_context_print: from the start of the model load to the end of the first eval, its warm-up
  of 2 tokens, so model load + context + one tiny forward) and the process's wall time and peak RSS. With mmap the weights are file pages mapped, counted in RSS once
  touched (the warm-up decode and the prompt touch them all).
  ours: a child process that imports torch and mixtral_infer (``rss_after_import_mb``, its VmHWM then), then times
  ``load_model(F, max_batch_size=1, device="cpu", quantize=Q)``, Q None (the file's default) and
  int8 (Q8_0) / int4 (Q4_0); peak RSS of the child, and its RSS after the load.
decode (batch 1): llama.cpp ``run_compare.llama_bench(F, ["decode"])`` (llama-bench -t 2 -n 128 -r 3)
  against ``bench/ours_run.py F --dtype bfloat16 --quantize int8|int4 --what decode`` (128 tokens after
  a 64-token prompt, eager loop).

While the rounds run, /tmp/BENCH_RUNNING holds the expected end time (deleted at the end).
"""
import argparse
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAIN = HERE.parents[1]
sys.path.insert(0, str(HERE))
import run_compare as rc  # noqa: E402

SIGN = Path("/tmp/BENCH_RUNNING")
OURS_QUANT = {"q8_0": "int8", "q4_0": "int4"}


def vm(field):
    """/proc/self/status's ``field`` in MB: VmHWM (peak RSS) and VmRSS belong to this process's own memory
    map, made at exec (getrusage's ru_maxrss also counts the forking parent's RSS, which exec carries over)."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024


def child_load(path, quantize):
    """In a fresh process: peak RSS after the imports, then load_model's time and peak RSS."""
    import torch  # noqa: F401

    from mixtral_infer import load_model

    import gguf  # noqa: F401  (the reader load_model uses)

    rss_import = vm("VmHWM")
    start = time.perf_counter()
    model = load_model(path, max_batch_size=1, device="cpu", quantize=quantize)
    load_s = time.perf_counter() - start
    peak, rss_now = vm("VmHWM"), vm("VmRSS")
    from mixtral_infer.serve.sizing import weight_bytes

    dtypes = sorted({str(p.dtype) for p in model.parameters()} | {str(b.dtype) for b in model.buffers()})
    print(json.dumps({"load_s": load_s, "rss_after_import_mb": rss_import, "peak_rss_mb": peak,
                      "rss_after_load_mb": rss_now, "weights_bytes": weight_bytes(model), "tensor_dtypes": dtypes,
                      "torch_threads": torch.get_num_threads()}))


def run_rusage(cmd):
    """Run ``cmd`` under /usr/bin/time; (wall s, peak RSS MB of that process, stdout, stderr). Not wait4's
    ru_maxrss of our own child: exec carries the forking parent's RSS (this script's, GBs) into it; the small
    /usr/bin/time forks the command itself."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as tf:
        t0 = time.perf_counter()
        p = subprocess.run(["/usr/bin/time", "-f", "%M %e", "-o", tf.name, *cmd], stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        wall = time.perf_counter() - t0
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        maxrss_kb = int(tf.read().split()[-2])
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {stderr[-2000:]}")
    return wall, maxrss_kb / 1024, stdout, stderr


def llama_load(path, mmap):
    cmd = [str(rc.LLAMA / "build/bin/llama-completion"), "-m", str(path), "-t", "2", "-n", "1", "-p", "hi", "-no-cnv"]
    if not mmap:
        cmd += ["--load-mode", "none"]  # this llama.cpp's --no-mmap
    wall, rss, _, err = run_rusage(cmd)
    m = re.search(r"load time\s*=\s*([\d.]+) ms", err)
    return {"cmd": " ".join(cmd), "mmap": mmap, "load_s": float(m.group(1)) / 1e3 if m else None,
            "process_wall_s": wall, "peak_rss_mb": rss}


def ours_load(path, quantize):
    cmd = [rc.PY, __file__, "--child-load", str(path), "--child-quantize", str(quantize)]
    wall, rss, out, err = run_rusage(cmd)
    res = json.loads(out.strip().splitlines()[-1])
    res.update(cmd=" ".join(cmd), quantize=quantize, process_wall_s=wall, process_peak_rss_mb=rss,
               loading_line=[l for l in err.splitlines() if ".gguf:" in l][-1:])
    return res


def ours_decode(path, quantize):
    return rc.ours_run(path, ["--dtype", "bfloat16", "--quantize", quantize, "--what", "decode"])


def sign(end):
    SIGN.write_text(f"benchmark (bench/llamacpp/run_gguf.py, pid {os.getpid()}) running; expected end "
                    f"{time.strftime('%H:%M:%S', time.localtime(end))} ({end:.0f}); please avoid heavy CPU work\n")


def machine_info():
    import torch

    cpu = Path("/proc/cpuinfo").read_text()
    flags = re.search(r"^flags\s*:\s*(.*)$", cpu, re.M).group(1).split()
    changelog = (rc.LLAMA.parents[1] / "CHANGELOG.md").read_text()
    return {
        "cpu": re.search(r"^model name\s*:\s*(.*)$", cpu, re.M).group(1),
        "cores": os.cpu_count(),
        "simd_flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))),
        "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch": torch.__version__, "python": platform.python_version(),
        "llama_cpp": str(rc.LLAMA),
        "llama_cpp_commit": re.search(r"## \[[\d.]+\]\s+- feat: update llama.cpp to (\S+)", changelog).group(1)
        + " (llama_cpp_python 0.3.36 sdist; no .git, so the binaries report build_commit 'unknown')",
        "mixtral_infer_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=MAIN, capture_output=True,
                                               text=True).stdout.strip(),
        "mixtral_infer_dirty": bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=MAIN,
                                                   capture_output=True, text=True).stdout.strip()),
    }


def med(runs, key):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(entry):
    s = {}
    for system, runs in entry["runs"].items():
        s[system] = {k: med(runs, k) for k in ("load_s", "peak_rss_mb", "process_wall_s", "rss_after_import_mb",
                                               "rss_after_load_mb", "decode_tok_s") if med(runs, k) is not None}
        s[system]["n"] = len(runs)
    l_mmap, l_nommap, l_dec = s.get("llama_load_mmap"), s.get("llama_load_nommap"), s.get("llama_decode")
    ratios = {}
    for system in s:
        if system.startswith("ours_load"):
            o = s[system]
            for name, l in (("mmap", l_mmap), ("nommap", l_nommap)):
                if l and l.get("load_s"):
                    ratios[f"{system}/llama_{name}_load_s"] = round(o["load_s"] / l["load_s"], 2)
                    ratios[f"{system}/llama_{name}_process_wall_s"] = round(o["process_wall_s"] / l["process_wall_s"], 2)
                    ratios[f"{system}/llama_{name}_peak_rss"] = round(o["peak_rss_mb"] / l["peak_rss_mb"], 2)
    if s.get("ours_decode") and l_dec:
        ratios["ours_decode/llama_decode_tok_s"] = round(s["ours_decode"]["decode_tok_s"] / l_dec["decode_tok_s"], 3)
    entry["summary"], entry["ratios"] = s, ratios


def print_table(results):
    print(f"{'file':22s} {'system':26s} {'load s':>8s} {'wall s':>8s} {'peak MB':>9s} {'import MB':>9s} {'tok/s':>7s}")
    for key, e in results.items():
        if key == "machine":
            continue
        for system, v in e.get("summary", {}).items():
            f = lambda k, spec: format(v[k], spec) if v.get(k) is not None else format("-", ">" + spec.split(".")[0])  # noqa: E731
            print(f"{key:22s} {system:26s} {f('load_s', '8.2f')} {f('process_wall_s', '8.2f')} {f('peak_rss_mb', '9.0f')} "
                  f"{f('rss_after_import_mb', '9.0f')} {f('decode_tok_s', '7.2f')}")
        for k, r in e.get("ratios", {}).items():
            print(f"{'':22s} {k}: {r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="mistral-wide")
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_0"])
    ap.add_argument("--quiet", type=float, default=0.1, help="max cores used by other processes before a run")
    ap.add_argument("--max-wait", type=float, default=900, help="longest quiet-CPU wait before a run (s)")
    ap.add_argument("--attempts", type=int, default=5, help="runs of one step while others disturb it")
    ap.add_argument("--minutes", type=float, default=40, help="expected duration, written to /tmp/BENCH_RUNNING")
    ap.add_argument("--out", type=Path, default=HERE / "results_gguf.json")
    ap.add_argument("--child-load", help=argparse.SUPPRESS)
    ap.add_argument("--child-quantize", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_load:
        return child_load(a.child_load, None if a.child_quantize == "None" else a.child_quantize)
    rc.LOG = open(a.out.with_suffix(".log"), "a")
    rc.wait_quiet = functools.partial(rc.wait_quiet, max_wait=a.max_wait)  # run_compare.timed calls it by this name
    timed = functools.partial(rc.timed, quiet=a.quiet, attempts=a.attempts)
    results = json.loads(a.out.read_text()) if a.out.is_file() else {}
    results["machine"] = machine_info()
    files = {t: rc.MODELS / f"{a.model}-{t}.gguf" for t in a.types}
    for t, path in files.items():
        if not path.is_file():
            sys.exit(f"{path} not found: bench/llamacpp/make_models.py --models {a.model} --types f32 {t}")
    try:
        sign(time.time() + a.minutes * 60)
        for path in files.values():
            path.read_bytes()  # into the page cache, for both sides alike
            rc.log(f"warm-up: ours loads {path.name} (fills the machine-tuning cache if empty), llama.cpp loads it")
            ours_load(path, None)
            llama_load(path, True)
        for t, path in files.items():
            key = f"{a.model}/{t}"
            entry = {"file": str(path), "file_bytes": path.stat().st_size, "runs": {}}
            q = OURS_QUANT[t]
            steps = [("llama_load_mmap", lambda: llama_load(path, True)),
                     ("ours_load_default", lambda: ours_load(path, None)),
                     ("llama_load_nommap", lambda: llama_load(path, False)),
                     (f"ours_load_{q}", lambda: ours_load(path, q)),
                     ("llama_decode", lambda: rc.llama_bench(path, ["decode"])),
                     ("ours_decode", lambda: ours_decode(path, q))]
            for r in range(a.rounds):
                rc.log(f"== {key} round {r + 1}/{a.rounds}")
                for system, fn in steps:
                    res = timed(system, fn)
                    rc.log(f"  {system}: " + ", ".join(f"{k} {res[k]:.2f}" for k in ("load_s", "process_wall_s", "peak_rss_mb",
                           "rss_after_import_mb", "decode_tok_s") if isinstance(res.get(k), float)))
                    entry["runs"].setdefault(system, []).append(res)
                summarize(entry)
                results[key] = entry
                a.out.write_text(json.dumps(results, indent=1) + "\n")
    finally:
        SIGN.unlink(missing_ok=True)
    print_table(results)


if __name__ == "__main__":
    main()
