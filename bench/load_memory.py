"""Peak memory (anonymous and file-backed, separately) and time of ``load_model``, for several source trees.

Builds a random float32 Mixtral-layout checkpoint with the bench shapes at 4 layers (dim 1024,
16 heads / 4 KV heads of 64, 8 experts of hidden 3584, vocab 32000: 1.71 GB), once as a Mistral
folder (one ``consolidated.safetensors``) and once as a Hugging Face folder (shards of 500 MB),
then loads each in a fresh subprocess per source tree (``--tree NAME=DIR``, e.g. a ``git archive``
of main, and this tree):

* ``mistral``: ``load_model(folder, device="cpu", dtype=torch.float32)``;
* ``hf``: the same from the Hugging Face folder;
* ``mistral-tp2``: rank 0 of ``--tensor_parallel 2`` (``Parallel(tensor_parallel=2)``, no process
  group needed to load): half the experts and half of every attention matrix.

A thread samples ``RssAnon`` and ``RssFile`` (/proc/self/status) every 2 ms; ``VmHWM`` is the
kernel's own peak of their sum. Values are over the process's state just before loading. The
checkpoint was just written, so its pages are in the page cache: this measures memory and CPU
work, not the disk.

    .venv/bin/python bench/load_memory.py --tree main=/tmp/main-tree --tree this=. --out bench/load_memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_memory import build_checkpoint, medians, run_in_tree  # noqa: E402

CHILD = textwrap.dedent(
    """
    import json, sys, threading, time

    import torch

    from mixtral_infer import load_model
    from mixtral_infer.model.parallel import Parallel

    folder, case = sys.argv[1], sys.argv[2]

    def status():
        fields = {}
        for line in open("/proc/self/status"):
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
        return fields

    torch.ones(1) @ torch.ones(1)
    base = status()
    peak = dict(base)
    done = threading.Event()

    def sample():
        while not done.is_set():
            for key, value in status().items():
                peak[key] = max(peak[key], value)
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    parallel = Parallel(tensor_parallel=2, rank=0) if case.endswith("tp2") else Parallel()
    start = time.perf_counter()
    model = load_model(folder, device="cpu", dtype=torch.float32, parallel=parallel)
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    end = status()
    print(json.dumps({
        "seconds": seconds,
        "model_bytes": sum(p.nbytes for p in model.parameters()),
        "peak_anon": peak["RssAnon"] - base["RssAnon"],
        "peak_file_backed": peak["RssFile"] - base["RssFile"],
        "peak_total_hwm": end["VmHWM"] - base["VmHWM"],
        "end_anon": end["RssAnon"] - base["RssAnon"],
        "end_file_backed": end["RssFile"] - base["RssFile"],
    }))
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="NAME=DIR: a source tree holding mixtral_infer/")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    options = parser.parse_args()
    trees = dict(tree.split("=", 1) for tree in options.tree)
    workdir = Path(tempfile.mkdtemp(prefix="load-memory-", dir=options.workdir))
    checkpoint_bytes = build_checkpoint(workdir / "mistral", dim=1024, n_layers=4, hidden=3584, experts=8)
    from mixtral_infer.checkpoint.convert import convert

    convert(workdir / "mistral", workdir / "hf", to="hf", max_shard_size="500MB")
    print(f"checkpoint: {checkpoint_bytes / 1e9:.2f} GB float32 in {workdir}", file=sys.stderr)
    results = {"checkpoint_bytes": checkpoint_bytes, "trees": {}, "runs": []}
    for name, tree in trees.items():
        results["trees"][name] = str(Path(tree).resolve())
    for case in ("mistral", "hf", "mistral-tp2"):
        folder = workdir / ("hf" if case == "hf" else "mistral")
        for repeat in range(options.repeats):
            for name, tree in trees.items():  # alternating, so that a drift of the machine hits every tree
                run = run_in_tree(CHILD, [folder, case], tree, workdir)
                run.update(tree=name, case=case, repeat=repeat)
                results["runs"].append(run)
                print(
                    f"{case:12} {name:8}: {run['seconds']:5.2f} s, peak anonymous {run['peak_anon'] / 1e6:5.0f} MB, "
                    f"file-backed {run['peak_file_backed'] / 1e6:5.0f} MB, total {run['peak_total_hwm'] / 1e6:5.0f} MB "
                    f"(model {run['model_bytes'] / 1e6:.0f} MB)",
                    file=sys.stderr,
                )
    groups = {
        f"{case} {name}": lambda r, key=(case, name): (r["case"], r["tree"]) == key
        for case in ("mistral", "hf", "mistral-tp2")
        for name in trees
    }
    keys = ("seconds", "peak_anon", "peak_file_backed", "peak_total_hwm", "end_anon", "end_file_backed")
    results["median"] = medians(results["runs"], groups, keys)
    subprocess.run(["rm", "-rf", str(workdir)], check=True)
    if options.out is not None:
        options.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
