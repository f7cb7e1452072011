"""Load time and memory of two commits of this package, alternating in one run: ``load_model`` of the
same checkpoints (GGUF files, folders) from each.

Usage:
    python bench/compare_load.py OLD [NEW] --files A.gguf B.gguf [--rounds 2] [--dtype bfloat16]
        [--quantize int4] [--out results.json]

``OLD`` and ``NEW`` (default: the working tree) are git revisions, checked out once each in a
temporary worktree (``compare_commits.worktree``). Per round and file, a fresh process of each tree
(the order flips every round) loads the file and reports ``load_model``'s seconds, the process's peak
resident memory (VmHWM) and its resident memory after the load once garbage is collected (VmRSS). The
files should be in the page cache: the first round reads them first.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from compare_commits import worktree  # noqa: E402

CHILD = """
import gc, json, re, sys, time
from pathlib import Path
import torch
from mixtral_infer import load_model

def vm(field):
    return int(re.search(field + r":\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024

start = time.perf_counter()
model = load_model(sys.argv[1], max_batch_size=1, device="cpu", dtype=getattr(torch, sys.argv[2]),
                   quantize=sys.argv[3] or None)
load_s = time.perf_counter() - start
gc.collect()
print(json.dumps({"load_s": load_s, "peak_mb": vm("VmHWM"), "rss_after_mb": vm("VmRSS")}))
"""


def one_load(tree: Path, path: str, dtype: str, quantize: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", CHILD, path, dtype, quantize], env=env, cwd=tree,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default=None)
    ap.add_argument("--files", nargs="+", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--quantize", default="")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    trees = {"old": worktree(args.old), "new": worktree(args.new) if args.new else REPO}
    for path in args.files:  # into the page cache
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    runs = {(side, path): [] for side in trees for path in args.files}
    try:
        for round_ in range(args.rounds):
            order = ["old", "new"] if round_ % 2 == 0 else ["new", "old"]
            for path in args.files:
                for side in order:
                    result = one_load(trees[side], path, args.dtype, args.quantize)
                    runs[side, path].append(result)
                    print(f"round {round_ + 1} {side} {Path(path).name}: {json.dumps(result)}", flush=True)
    finally:
        for side, tree in trees.items():
            if tree != REPO:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    summary = {}
    for path in args.files:
        row = {side: {key: statistics.median(r[key] for r in runs[side, path]) for key in ("load_s", "peak_mb", "rss_after_mb")}
               for side in trees}  # fmt: skip
        summary[Path(path).name] = row
        print(f"{Path(path).name}: load {row['old']['load_s']:.2f} -> {row['new']['load_s']:.2f} s, "
              f"peak {row['old']['peak_mb']:.0f} -> {row['new']['peak_mb']:.0f} MB, "
              f"resident after {row['old']['rss_after_mb']:.0f} -> {row['new']['rss_after_mb']:.0f} MB")  # fmt: skip
    if args.out is not None:
        record = {"old": args.old, "new": args.new or "working tree", "dtype": args.dtype, "quantize": args.quantize,
                  "runs": {f"{side} {Path(path).name}": r for (side, path), r in runs.items()}, "medians": summary}  # fmt: skip
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
