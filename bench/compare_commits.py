"""Decode speed of two commits of this package, alternating in one run: does a change slow anything?

Usage:
    python bench/compare_commits.py OLD [NEW] [--models mistral-wide mixtral-wide]
        [--kinds bf16 int8 int4] [--decode loop compiled] [--rounds 3] [--out results.json]

``OLD`` and ``NEW`` (default: the working tree) are git revisions; each is checked out once in a
temporary worktree (the working tree is used as it is for NEW). Per round, for every (model, kind,
decode mode), ``bench/ours_run.py --what decode`` runs once from each tree, OLD and NEW in turns (the
order flips every round), so slow drifts of a shared machine hit both alike. Models are the
``bench_vs_transformers.SHAPES`` of those names, random weights saved once as Hugging Face folders
in bfloat16 under ``--models-dir``.

Prints, per configuration, the median tokens/s of each side, NEW / OLD, and the same-code noise: the
largest ratio between two rounds of one side (a change smaller than that cannot be told apart).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
KINDS = {"bf16": [], "int8": ["--quantize", "int8"], "int4": ["--quantize", "int4"]}


def model_folder(name: str, root: Path) -> Path:
    """The Hugging Face folder of benchmark shape ``name`` (made on first use, bfloat16)."""
    folder = root / f"{name}-hf-bf16"
    if not (folder / "config.json").is_file():
        sys.path.insert(0, str(HERE))
        import torch
        import bench_vs_transformers as b

        model = b.hf_model(b.bench_args(name, max_batch_size=1)).to(torch.bfloat16)
        model.save_pretrained(folder, safe_serialization=True)
    return folder


def worktree(revision: str) -> Path:
    """A checkout of ``revision`` in a temporary folder (``git worktree``)."""
    path = Path(tempfile.mkdtemp(prefix="compare-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), revision], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return path


def one_run(tree: Path, folder: Path, kind: str, decode: str) -> float:
    """Decode tokens/s of one ``ours_run.py`` run from ``tree``."""
    cmd = [sys.executable, str(tree / "bench/ours_run.py"), str(folder), "--dtype", "bfloat16", *KINDS[kind],
           "--what", "decode", "--decode", decode]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default=None)
    ap.add_argument("--models", nargs="+", default=["mistral-wide", "mixtral-wide"])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--decode", nargs="+", default=["loop", "compiled"], choices=["loop", "eager", "static", "compiled"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models-dir", type=Path, default=Path(os.environ.get("LLAMA_WORK", "/tmp/llama")) / "models")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    a.models_dir.mkdir(parents=True, exist_ok=True)
    trees = {"old": worktree(a.old), "new": worktree(a.new) if a.new else REPO}
    folders = {name: model_folder(name, a.models_dir) for name in a.models}
    configs = [(m, k, d) for m in a.models for k in a.kinds for d in a.decode]
    seen = {c: {"old": [], "new": []} for c in configs}
    for r in range(a.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        for config in configs:
            for side in order:
                tok_s = one_run(trees[side], folders[config[0]], *config[1:])
                seen[config][side].append(tok_s)
                print(f"round {r} {'/'.join(config)} {side}: {tok_s:.2f} tok/s", file=sys.stderr, flush=True)
    rows = []
    print(f"{'model':14} {'kind':5} {'decode':9} {'old tok/s':>9} {'new tok/s':>9} {'new/old':>7} {'noise':>6}")
    for config, sides in seen.items():
        old, new = statistics.median(sides["old"]), statistics.median(sides["new"])
        noise = max(max(v) / min(v) for v in sides.values())
        rows.append({"model": config[0], "kind": config[1], "decode": config[2], "old": sides["old"], "new": sides["new"],
                     "ratio": new / old, "noise": noise})  # fmt: skip
        print(f"{config[0]:14} {config[1]:5} {config[2]:9} {old:9.2f} {new:9.2f} {new / old:7.3f} {noise:6.3f}")
    if a.out:
        a.out.write_text(json.dumps({"old": a.old, "new": a.new or "working tree", "rows": rows}, indent=1))
    if a.new:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees["new"])], check=False)
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees["old"])], check=False)


if __name__ == "__main__":
    main()
