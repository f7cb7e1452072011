"""Plots of the benchmark results: one PNG per result file, written next to it.

    python bench/plots.py              # every results file in bench/ and bench/llamacpp/
    python bench/plots.py FILE [...]   # these files only

``bench/results_serve.json`` gives ``bench/results_serve.png``, and so on. Each script of bench/
calls its function here after writing its JSON (``plot_after_run``), so a run leaves its plot beside
its figures. matplotlib comes with the ``bench`` extra (``pip install -e '.[bench]'``).

What each plot shows (tokens/s are generated tokens per second; higher is better):

- ``plot_llamacpp`` (``bench/llamacpp/run_compare.py``): per model, decode tokens/s (batch 1,
  128 tokens) and prefill tokens/s (a 2048-token prompt) for each llama.cpp type beside ours at the
  same width (f32 / float32, bf16 / bfloat16, q8_0 / int8, q4_0 / int4); the median of the rounds,
  with the slowest and fastest round as the error bar.
- ``plot_transformers`` (``bench/bench_vs_transformers.py``): per model, decode tokens/s by batch
  size and prefill tokens/s, ours beside transformers on the same weights.
- ``plot_gpu`` (``bench/bench_gpu.py``): per model, decode tokens/s by batch size (ours eager and
  compiled, transformers eager and compiled, the weight-read floor), prefill tokens/s by prompt
  length, and batch-1 decode tokens/s by quantization scheme: the panels the file has rows for.
- ``plot_serve`` (``bench/bench_serve.py``): throughput, and time to first token and latency
  (median and 99th percentile), of each serving mode on the same arrivals.
- ``plot_quant_schemes`` (``bench/quant_schemes.py``): compiled decode tokens/s of each
  quantization scheme, one group per run (model and batch), with every round's spread.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
OURS, PEER = "#1f77b4", "#ff7f0e"  # ours blue, the peer orange, in every plot
SHADES = {"ours": OURS, "ours_compiled": "#0b4f8a", "ours_eager": "#8fbce6", "ours_fast": OURS,
          "llama": PEER, "transformers": PEER, "transformers_eager": "#ffc285", "transformers_compiled": PEER,
          "floor": "#b0b0b0"}  # fmt: skip


# --------------------------------------------------------------------------- drawing


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, groups: Sequence[str], series: Dict[str, List[Optional[float]]], colors: Dict[str, str],
          spread: Optional[Dict[str, List[Optional[Sequence[float]]]]] = None, fmt: str = "{:.0f}",
          log: bool = False) -> None:  # fmt: skip
    """Grouped bars: ``groups`` along x, one bar per series in each (``series[name][i]``, None: no bar),
    its value written above it; ``spread[name][i]``: values drawn as a min-max error bar."""
    names = [n for n, v in series.items() if any(x is not None for x in v)]
    width = 0.8 / max(len(names), 1)
    top = max((x for n in names for x in series[n] if x is not None), default=1.0)
    for k, name in enumerate(names):
        for i, value in enumerate(series[name]):
            if value is None:
                continue
            x = i - 0.4 + width * (k + 0.5)
            ax.bar(x, value, width * 0.92, color=colors.get(name), label=name if i == _first(series[name]) else None)
            runs = [r for r in (spread or {}).get(name, [None] * len(groups))[i] or [] if r]
            if len(runs) > 1:
                ax.errorbar(x, value, yerr=[[max(value - min(runs), 0)], [max(max(runs) - value, 0)]],
                            fmt="none", ecolor="#333333", elinewidth=0.8, capsize=2)  # fmt: skip
            label_y = max([value] + runs)
            ax.annotate(fmt.format(value), (x, label_y), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=7, rotation=90 if len(names) > 3 else 0)  # fmt: skip
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    if len(groups) == 1:
        ax.set_xlim(-1.2, 1.2)
    if log:
        ax.set_yscale("log")
        bottom = min((x for n in names for x in series[n] if x), default=1.0)
        ax.set_ylim(bottom * 0.5, top * 12)  # room above for the labels and the legend
    else:
        ax.set_ylim(0, top * 1.3)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _first(values: Sequence[Optional[float]]) -> int:
    return next(i for i, v in enumerate(values) if v is not None)


def _save(fig, title: str, note: str, out: Path) -> Path:
    fig.suptitle(title, fontsize=11)
    if note:
        fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=7.5, color="#444444", wrap=True)
    fig.tight_layout(rect=(0, 0.05 if note else 0, 1, 1))  # leaves room for the suptitle itself
    fig.savefig(out, dpi=110)
    _pyplot().close(fig)
    return out


def _legend(ax, labels: Dict[str, str]) -> None:
    handles, names = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, [labels.get(n, n) for n in names], fontsize=7.5, loc="upper left", ncol=min(len(names), 3),
                  frameon=False, columnspacing=1.0, handlelength=1.2)


def _join(*parts) -> str:
    """The parts that are there, comma-separated."""
    return ", ".join(str(p) for p in parts if p)


def _load(path: Path):
    text = Path(path).read_text()
    if Path(path).suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


# --------------------------------------------------------------------------- llama.cpp

LLAMA_TYPES = ("f32", "bf16", "q8_0", "q4_0")
LLAMA_SYSTEMS = {"llama": "llama.cpp (llama-bench)", "ours": "ours (eager loop)", "ours_compiled": "ours (compiled)"}


def plot_llamacpp(path: Path, out: Optional[Path] = None) -> Path:
    """``bench/llamacpp/run_compare.py``'s JSON: decode and prefill tokens/s, ours beside llama.cpp,
    per model and type."""
    path = Path(path)
    data = {k: v for k, v in _load(path).items() if isinstance(v, dict) and "llama_summary" in v}
    models = list(dict.fromkeys(k.split("/")[0] for k in data))
    metrics = [m for m in ("decode", "prefill")
               if any(e.get(s + "_summary", {}).get(m + "_tok_s") for e in data.values() for s in LLAMA_SYSTEMS)]  # fmt: skip
    plt = _pyplot()
    fig, axes = plt.subplots(len(metrics), len(models), figsize=(max(5.6 * len(models), 7.0), 4.0 * len(metrics)), squeeze=False)
    rounds = set()
    for col, model in enumerate(models):
        types = sorted((k.split("/")[1] for k in data if k.split("/")[0] == model),
                       key=lambda t: LLAMA_TYPES.index(t) if t in LLAMA_TYPES else len(LLAMA_TYPES))  # fmt: skip
        entries = [data[f"{model}/{t}"] for t in types]
        groups = [f"{t}\n/ {_ours_type(e)}" for t, e in zip(types, entries)]
        for row, metric in enumerate(metrics):
            series, spread = {}, {}
            for system in LLAMA_SYSTEMS:
                summaries = [e.get(system + "_summary") for e in entries]
                series[system] = [s.get(metric + "_tok_s") if s else None for s in summaries]
                spread[system] = [[r for r in s.get(metric + "_runs", []) if r] if s else None for s in summaries]
                rounds.update(len(e.get(system, [])) for e in entries if e.get(system))
            ax = axes[row][col]
            _bars(ax, groups, series, SHADES, spread)
            what = "decode, batch 1, 128 tokens" if metric == "decode" else "prefill, one 2048-token prompt"
            ax.set_title(f"{model}: {what}", fontsize=9.5)
            ax.set_ylabel("tokens/s")
            ax.set_xlabel("llama.cpp type / ours", fontsize=8)
            _legend(ax, LLAMA_SYSTEMS)
    first = next((r for e in data.values() for r in e.get("llama", [])), {})
    ours = next((r for e in data.values() for s in ("ours", "ours_compiled") for r in e.get(s, [])), {})
    machine = _join(first.get("cpu_info"), ours.get("threads") and f"{ours['threads']} threads",
                    first.get("build") and f"llama.cpp {first['build'][0]}")  # fmt: skip
    title = "Beside llama.cpp on CPU: tokens/s" + (f"\n{machine}" if machine else "")
    note = (f"Median of {'/'.join(str(r) for r in sorted(rounds))} alternating rounds, error bars the slowest and "
            f"fastest; same weights in both (bench/llamacpp/run_compare.py, {path.name})")  # fmt: skip
    return _save(fig, title, note, Path(out) if out else path.with_suffix(".png"))


def _ours_type(entry: Dict) -> str:
    run = next((r for s in ("ours", "ours_compiled") for r in entry.get(s, [])), {})
    return run.get("quantize") or run.get("dtype") or "?"


# --------------------------------------------------------------------------- transformers


def plot_transformers(path: Path, out: Optional[Path] = None) -> Path:
    """``bench/bench_vs_transformers.py``'s JSON: decode tokens/s by batch size and prefill tokens/s,
    ours beside transformers, per model."""
    path = Path(path)
    data = _load(path)
    models = data["models"]
    plt = _pyplot()
    fig, axes = plt.subplots(len(models), 2, figsize=(10.5, 3.6 * len(models)), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 3]})  # fmt: skip
    settings = data.get("settings", {})
    for row, (name, model) in enumerate(models.items()):
        decode = model.get("decode") or []
        ax = axes[row][0]
        _bars(ax, [f"batch {d['batch']}" for d in decode],
              {"ours": [d.get("ours_tok_s") for d in decode], "transformers": [d.get("hf_tok_s") for d in decode]},
              SHADES)  # fmt: skip
        ax.set_title(f"{name}: decode, {settings.get('new_tokens', 128)} tokens", fontsize=9.5)
        ax.set_ylabel("tokens/s")
        _legend(ax, {})
        prefill = model.get("prefill") or []
        prefill = [prefill] if isinstance(prefill, dict) else prefill
        ax = axes[row][1]
        groups = [f"{p.get('tokens')} tokens\nchunk {p.get('chunk', '-')}{' (default)' if p.get('default_chunk') else ''}"
                  f"\n{p.get('logits', 'last')} logits" for p in prefill]  # fmt: skip
        _bars(ax, groups, {"ours": [p.get("ours_tok_s") for p in prefill],
                           "transformers": [p.get("hf_tok_s") for p in prefill]}, SHADES)  # fmt: skip
        ax.set_title(f"{name}: prefill of one prompt", fontsize=9.5)
        ax.set_ylabel("tokens/s")
        _legend(ax, {})
    m = data.get("machine", {})
    machine = _join(m.get("cpu"), m.get("cores") and f"{m['cores']} cores", m.get("torch") and f"torch {m['torch']}",
                    m.get("transformers") and f"transformers {m['transformers']}")  # fmt: skip
    title = f"Beside transformers on CPU, {m.get('dtype', 'float32')}: tokens/s\n{machine}"
    note = (f"Same random weights in both, {settings.get('layers', '?')} layers; median of {settings.get('repeats', '?')} "
            f"runs, decode timed from the first new token to the last (bench/bench_vs_transformers.py, {path.name})")  # fmt: skip
    return _save(fig, title, note, Path(out) if out else path.with_suffix(".png"))


# --------------------------------------------------------------------------- GPU

GPU_DECODE = {"ours_eager": "ours eager", "ours_fast": "ours compiled", "transformers_eager": "transformers eager",
              "transformers_compiled": "transformers compiled", "floor": "floor (weights read once)"}  # fmt: skip


def plot_gpu(path: Path, out: Optional[Path] = None) -> Path:
    """``bench/bench_gpu.py``'s JSON: decode tokens/s by batch size, prefill tokens/s by prompt length,
    quantized decode tokens/s by scheme; ours beside transformers where the file has them."""
    path = Path(path)
    data = _load(path)
    models = data["models"]
    kinds = [k for k in ("decode", "prefill", "quantized") if any(m.get(k) for m in models.values())]
    plt = _pyplot()
    widths = {"decode": 3, "prefill": 2, "quantized": 2}
    fig, axes = plt.subplots(len(models), len(kinds), squeeze=False,
                             figsize=(max(2.1 * sum(widths[k] for k in kinds) + 1, 6.5), 3.8 * len(models) + 0.4),
                             gridspec_kw={"width_ratios": [widths[k] for k in kinds]})  # fmt: skip
    alone = []
    for row, (name, model) in enumerate(models.items()):
        layers = f"{name}, {model.get('layers')} layers" if model.get("layers") else name
        if model.get("transformers") is False:
            alone.append(name)
        for col, kind in enumerate(kinds):
            ax, rows = axes[row][col], model.get(kind) or []
            if kind == "decode":
                values = [r.get(k) for r in rows for k in GPU_DECODE if r.get(k)]
                _bars(ax, [f"batch {r['batch']}" for r in rows], {k: [r.get(k) for r in rows] for k in GPU_DECODE},
                      SHADES, log=bool(values) and max(values) > 20 * min(values))  # fmt: skip
                ax.set_title(f"{layers}: decode", fontsize=9.5)
                _legend(ax, GPU_DECODE)
            elif kind == "prefill":
                _bars(ax, [f"{r['tokens']} tokens" for r in rows],
                      {"ours": [r.get("ours_tok_s") for r in rows], "transformers": [r.get("transformers_tok_s") for r in rows]},
                      SHADES)  # fmt: skip
                ax.set_title(f"{layers}: prefill, last logit", fontsize=9.5)
                _legend(ax, {})
            else:
                _bars(ax, [f"{r['scheme']}\nbatch {r.get('batch', 1)}" for r in rows],
                      {"ours_eager": [r.get("ours_eager") for r in rows], "ours_fast": [r.get("ours_fast") for r in rows]},
                      SHADES)  # fmt: skip
                ax.set_title(f"{layers}: quantized weights, decode", fontsize=9.5)
                _legend(ax, GPU_DECODE)
            ax.set_ylabel("tokens/s")
            if not rows:
                ax.axis("off")
                ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="#777777")
    m = data.get("machine", {})
    machine = _join(m.get("gpu") or m.get("device"), m.get("torch") and f"torch {m['torch']}",
                    m.get("transformers") and not alone and f"transformers {m['transformers']}")  # fmt: skip
    dtype = str(data.get("dtype", "")).removeprefix("torch.")
    title = f"On a GPU, {dtype} random weights: tokens/s\n{machine}"
    note = ("Median of the timed runs; 128 new tokens after 128-token prompts"
            + (f"; ours alone, transformers not run ({', '.join(alone)})" if alone else "")
            + f" (bench/bench_gpu.py, {path.name})")  # fmt: skip
    return _save(fig, title, note, Path(out) if out else path.with_suffix(".png"))


# --------------------------------------------------------------------------- serving

SERVE_MODES = {"continuous": "continuous\n(server, HTTP)", "engine": "engine\n(in process)",
               "engine-grouped": "engine,\nprompts grouped", "engine-torch-compile": "engine,\ntorch.compile",
               "static": "static\nbatches", "static-compiled": "static batches,\ncompiled",
               "sequential": "one at\na time"}  # fmt: skip


def plot_serve(path: Path, out: Optional[Path] = None) -> Path:
    """``bench/bench_serve.py``'s JSON: throughput, time to first token and latency of each mode
    (continuous batching beside static batches and one request at a time)."""
    path = Path(path)
    data = _load(path)
    modes = data["modes"]
    names = [m["mode"] for m in modes]
    groups = [SERVE_MODES.get(n, n) for n in names]
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 3]})
    peers = {"static", "static-compiled", "sequential"}
    for i, m in enumerate(modes):
        color = PEER if m["mode"] in peers else OURS
        value = m.get("throughput_tok_s")
        left.bar(i, value, 0.6, color=color)
        runs = m.get("throughput_runs_tok_s") or []
        if len(runs) > 1:
            left.errorbar(i, value, yerr=[[value - min(runs)], [max(runs) - value]], fmt="none", ecolor="#333333", capsize=2)
        left.annotate(f"{value:.0f}", (i, max([value] + runs)), xytext=(0, 2), textcoords="offset points",
                      ha="center", va="bottom", fontsize=7.5)  # fmt: skip
    left.set_xticks(range(len(groups)))
    left.set_xticklabels(groups, fontsize=7.5)
    left.set_ylim(0, max(max([m.get("throughput_tok_s") or 0] + (m.get("throughput_runs_tok_s") or [])) for m in modes) * 1.4)
    left.set_ylabel("generated tokens/s")
    left.set_title("throughput (higher is better)", fontsize=9.5)
    left.grid(axis="y", alpha=0.3)
    left.set_axisbelow(True)
    from matplotlib.patches import Patch

    left.legend([Patch(color=OURS), Patch(color=PEER)], ["continuous batching (ours)", "baselines without it"],
                fontsize=7.5, loc="upper right")  # fmt: skip
    shades = {"TTFT p50": "#9ecae1", "TTFT p99": "#3182bd", "latency p50": "#fdae6b", "latency p99": "#e6550d"}
    keys = {"TTFT p50": "ttft_p50_s", "TTFT p99": "ttft_p99_s", "latency p50": "latency_p50_s", "latency p99": "latency_p99_s"}
    _bars(right, groups, {k: [m.get(v) for m in modes] for k, v in keys.items()}, shades, fmt="{:.2f}")
    right.set_ylabel("seconds from arrival")
    right.set_title("time to first token and latency (lower is better)", fontsize=9.5)
    _legend(right, {})
    shape = data.get("model", "?") + (f", {data['layers']} layers" if data.get("layers") else "")
    setup = ", ".join(str(x) for x in (data.get("device"), data.get("dtype")) if x)
    title = (f"Serving under load: {shape}{' (' + setup + ')' if setup else ''}, {data.get('requests')} requests, "
             f"{data.get('clients')} clients, Poisson arrivals at {data.get('rate_per_s'):g}/s\n{data.get('machine', '')}")  # fmt: skip
    repeat = data.get("repeat") or 1
    note = (f"max_tokens {data.get('max_tokens', '?')}, prompts {data.get('prompt_words', '?')} words; "
            + (f"median of {repeat} runs" if repeat > 1 else "one run") + f" (bench/bench_serve.py, {path.name})")  # fmt: skip
    return _save(fig, title, note, Path(out) if out else path.with_suffix(".png"))


# --------------------------------------------------------------------------- quantization schemes

SCHEME_SHADES = {"int8": "#1f77b4", "int4": "#2ca02c", "nf4": "#9467bd", "w8a8": "#8c564b", "int4-128": "#17becf"}


def plot_quant_schemes(path: Path, out: Optional[Path] = None) -> Path:
    """``bench/quant_schemes.py``'s JSON lines: compiled decode tokens/s of each scheme, one group
    per line (model and batch), every round as the error bar."""
    path = Path(path)
    rows = _load(path)
    rows = rows if isinstance(rows, list) else [rows]
    schemes = list(dict.fromkeys(s for r in rows for s in r["tok_s"]))
    seen: Dict[str, int] = {}
    groups = []
    for r in rows:
        label = f"{Path(r.get('folder', '?')).name.removesuffix('-hf-notok')}\nbatch {r.get('batch', 1)}"
        seen[label] = seen.get(label, 0) + 1
        groups.append(label + (f", run {seen[label]}" if seen[label] > 1 else ""))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.5, 1.6 * len(rows) + 2), 4.2))
    _bars(ax, groups, {s: [r["tok_s"].get(s) for r in rows] for s in schemes}, SCHEME_SHADES,
          {s: [r.get("runs", {}).get(s) for r in rows] for s in schemes})  # fmt: skip
    ax.set_ylabel("decode tokens/s")
    ax.set_title("each scheme's copy of the same model, alternating in one process (higher is better)", fontsize=9)
    _legend(ax, {})
    first = rows[0]
    versions = sorted({f"{r.get('vendor', '?')}, torch {r.get('torch', '?')}, {r.get('threads', '?')} threads" for r in rows})
    title = f"Quantization schemes on CPU, {first.get('dtype', 'bfloat16')} activations: tokens/s\n{'; '.join(versions)}"
    note = (f"Compiled decode, 128 tokens after 64-token prompts; median of each line's rounds, error bars the slowest "
            f"and fastest (bench/quant_schemes.py, {path.name})")  # fmt: skip
    return _save(fig, title, note, Path(out) if out else path.with_suffix(".png"))


# --------------------------------------------------------------------------- dispatch

PLOTS: Dict[str, Callable[..., Path]] = {"llamacpp": plot_llamacpp, "transformers": plot_transformers, "gpu": plot_gpu,
                                         "serve": plot_serve, "quant_schemes": plot_quant_schemes}  # fmt: skip


def kind_of(path: Path) -> Optional[str]:
    """Which script wrote ``path``, from its contents (None: no plot for it)."""
    data = _load(path)
    if isinstance(data, list):
        return "quant_schemes" if data and "tok_s" in data[0] else None
    if "modes" in data and "clients" in data:
        return "serve"
    if "models" in data:
        return "transformers" if "settings" in data else "gpu"
    if any(isinstance(v, dict) and "llama_summary" in v for v in data.values()):
        return "llamacpp"
    return None


def plot_after_run(kind: str, path) -> Optional[Path]:
    """What the scripts call after writing their JSON: its plot, or one line saying why there is none."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"no plot of {path}: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return None
    try:
        png = PLOTS[kind](Path(path))
    except Exception as error:  # the figures are written already; a plot that fails does not lose them
        print(f"no plot of {path}: {type(error).__name__}: {error}", file=sys.stderr)
        return None
    print(f"plot: {png}", file=sys.stderr)
    return png


def result_files() -> List[Path]:
    return sorted([*HERE.glob("results*.json"), *HERE.glob("results*.jsonl"), *HERE.glob("llamacpp/results*.json")])


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="result files (default: every one in bench/)")
    files = parser.parse_args(argv).files or result_files()
    for path in files:
        kind = kind_of(path)
        if kind is None:
            print(f"{path}: not a result file these plots read, skipped")
            continue
        print(f"{path} -> {PLOTS[kind](path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
