"""Peak memory, disk and time of ``convert``, for several source trees (before / after a change).

Builds a random float32 Mistral-layout checkpoint (default about 1.7 GB: the bench shapes of
``bench_vs_transformers.py`` at 4 layers), then converts it in a fresh subprocess per source
tree (``--tree NAME=DIR``, e.g. a ``git archive`` of main, and this tree) and case:

* ``hf 5GB``: ``convert --to hf`` at the default ``max_shard_size`` (the whole model is one shard);
* ``hf 500MB``: the same in shards of at most 500 MB;
* ``mistral``: ``convert --to mistral`` (one ``consolidated.safetensors``, the hand-written writer).

A thread samples the process's anonymous and file-backed resident memory (``RssAnon``,
``RssFile`` in /proc/self/status, counted over their values just before converting) and the
bytes under the destination's folder every 5 ms.

    .venv/bin/python bench/convert_memory.py --tree main=/tmp/main-tree --tree this=. --out bench/convert_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from pathlib import Path

    import torch

    from mixtral_infer.checkpoint.convert import convert

    src, dst, target, shard = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]

    def status():
        fields = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
        return fields

    def disk_bytes():
        total = 0
        for root, _, files in os.walk(dst.parent):
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except FileNotFoundError:
                    pass
        return total

    torch.ones(1) @ torch.ones(1)
    base = status()
    peak = {"RssAnon": 0, "RssFile": 0, "disk": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            now = status()
            peak["RssAnon"] = max(peak["RssAnon"], now["RssAnon"])
            peak["RssFile"] = max(peak["RssFile"], now["RssFile"])
            peak["disk"] = max(peak["disk"], disk_bytes())
            time.sleep(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    convert(src, dst, to=target, max_shard_size=shard if shard != "-" else "5GB")
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    end = status()
    print(json.dumps({
        "seconds": seconds,
        "peak_anon_over_start": peak["RssAnon"] - base["RssAnon"],
        "peak_file_backed": peak["RssFile"] - base["RssFile"],
        "peak_hwm_over_start": end["VmHWM"] - base["VmHWM"] if end["VmHWM"] > base["VmHWM"] else 0,
        "peak_disk": peak["disk"],
        "files": sorted(p.name for p in dst.iterdir()),
    }))
    """
)


def build_checkpoint(folder: Path, dim: int, n_layers: int, hidden: int, experts: int) -> int:
    import torch

    from mixtral_infer import ModelArgs, MoeArgs, Transformer
    from mixtral_infer.checkpoint.loading import save_consolidated

    args = ModelArgs(
        dim=dim, n_layers=n_layers, head_dim=64, hidden_dim=hidden, n_heads=dim // 64, n_kv_heads=4, norm_eps=1e-5,
        vocab_size=32000, sliding_window=256, moe=MoeArgs(num_experts=experts, num_experts_per_tok=2),
    )
    torch.manual_seed(0)
    with torch.no_grad():
        model = Transformer(args)
        for param in model.parameters():
            param.normal_(0, 0.02)
    save_consolidated(model, folder)
    return (folder / "consolidated.safetensors").stat().st_size


def run_in_tree(child: str, args: list, tree: str, cwd: Path) -> dict:
    """Run the ``child`` script with ``tree`` first on the path (one torch thread); its JSON result."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(tree).resolve())}
    command = [sys.executable, "-c", child, *map(str, args)]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True, env=env, cwd=cwd).stdout)


def medians(runs: list, groups: dict, keys: tuple) -> dict:
    """For each ``label -> predicate(run)`` of ``groups``: the median of every key over the matching runs."""
    return {label: {key: statistics.median(r[key] for r in runs if match(r)) for key in keys} for label, match in groups.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="NAME=DIR: a source tree holding mixtral_infer/")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workdir", type=Path, default=None)
    options = parser.parse_args()
    trees = dict(tree.split("=", 1) for tree in options.tree)
    workdir = Path(tempfile.mkdtemp(prefix="convert-memory-", dir=options.workdir))
    checkpoint_bytes = build_checkpoint(workdir / "src", dim=1024, n_layers=options.layers, hidden=3584, experts=8)
    print(f"checkpoint: {checkpoint_bytes / 1e9:.2f} GB float32 in {workdir / 'src'}", file=sys.stderr)
    results = {"checkpoint_bytes": checkpoint_bytes, "trees": {n: str(Path(t).resolve()) for n, t in trees.items()}, "runs": []}
    cases = [("hf", "5GB"), ("hf", "500MB"), ("mistral", "")]
    for target, shard in cases:
        for repeat in range(options.repeats):
            for name, tree in trees.items():  # alternating, so that a drift of the machine hits every tree
                out = workdir / f"out-{name}"
                out.mkdir()
                run = run_in_tree(CHILD, [workdir / "src", out / "dst", target, shard or "-"], tree, workdir)
                run.update(tree=name, to=target, max_shard_size=shard or None, repeat=repeat)
                results["runs"].append(run)
                print(
                    f"{target:7} {shard:>6} {name:6}: {run['seconds']:6.1f} s, peak anonymous {run['peak_anon_over_start'] / 1e6:7.0f} MB, "
                    f"file-backed {run['peak_file_backed'] / 1e6:5.0f} MB, disk {run['peak_disk'] / 1e9:.2f} GB, "
                    f"{len(run['files'])} files",
                    file=sys.stderr,
                )
                subprocess.run(["rm", "-rf", str(out)], check=True)
    groups = {
        f"{target} {shard} {name}".replace("  ", " "): lambda r, key=(target, shard, name): (r["to"], r["max_shard_size"] or "", r["tree"]) == key
        for target, shard in cases
        for name in trees
    }
    results["median"] = medians(results["runs"], groups, ("seconds", "peak_anon_over_start", "peak_file_backed", "peak_disk"))
    subprocess.run(["rm", "-rf", str(workdir)], check=True)
    if options.out is not None:
        options.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
