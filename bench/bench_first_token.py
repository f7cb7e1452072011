"""Time to the first token from a fresh start, and on the second start, with the CPU's default decode
(``auto``: eager while the compiled step builds in the background) against the eager loop all the way
(``MIXTRAL_INFER_BACKGROUND_COMPILE=0``, the default before issue 75).

Each run is a new Python process that imports the package, loads ``--model`` (its default dtype) and
generates ``--max-tokens`` tokens for the demo's three prompts through ``generate(..., on_token=)``
(for a folder without a tokenizer, as ``compare_commits.py`` makes, the shipped tiny-mixtral's ids);
it reports, from the moment the process was started: the model loaded, the first token, the last.

* **fresh**: empty caches (``XDG_CACHE_HOME`` and ``TORCHINDUCTOR_CACHE_DIR`` in a new folder): the
  machine's tuning is measured and nothing is kept yet, as on a new machine;
* **second**: the caches one earlier run of the same kind left (the tuning, a kept compiled step).

Cases alternate within each round (``--rounds``); medians. ``--against REV`` adds ``auto second`` run from
a checkout of revision ``REV`` (``git worktree``), with caches of its own: the second start before a
change, in the same run.

    .venv/bin/python bench/bench_first_token.py --out bench/results_first_token.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_speculative import machine  # noqa: E402

CHILD = """
import json, sys, time
started = float(sys.argv[1])
from mixtral_infer import Tokenizer, generate, load_model
from mixtral_infer.cli.commands import DEMO_PROMPTS, model_folder
model = load_model(sys.argv[2], device="cpu", max_batch_size=len(DEMO_PROMPTS))
try:
    tokenizer = Tokenizer.from_folder(sys.argv[2])
except Exception:  # a folder of random weights (bench/compare_commits.py's): the shipped model's ids
    tokenizer = Tokenizer.from_folder(model_folder("tiny-mixtral"))
loaded = time.time() - started
times = []
generate([tokenizer.encode(p) for p in DEMO_PROMPTS], model, max_tokens=int(sys.argv[3]), ignore_eos=True,
         on_token=lambda row, token: times.append(time.time() - started))
print(json.dumps({"loaded_s": loaded, "first_token_s": times[0], "last_token_s": times[-1]}))
"""
CASES = ("eager fresh", "auto fresh", "eager second", "auto second")


def run(case: str, model: str, max_tokens: int, caches: Path, trees: dict) -> dict:
    mode, start, *revision = case.split()
    tree = trees[revision[0]] if revision else ROOT
    folder = Path(tempfile.mkdtemp()) if start == "fresh" else caches / "-".join([mode, *revision])
    env = {**os.environ, "XDG_CACHE_HOME": str(folder / "xdg"), "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
           "MIXTRAL_INFER_BACKGROUND_COMPILE": "0" if mode == "eager" else "1", "PYTHONPATH": str(tree)}  # fmt: skip
    started = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, str(started), model, str(max_tokens)], cwd=tree, env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    wait_for_builds()
    if start == "fresh":
        shutil.rmtree(folder, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_for_builds(limit_s: float = 180.0) -> None:
    """A background build goes on after its process has ended (forked, in its own process group): wait
    for it, so that it neither disturbs the next run nor loses its folder."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        found = subprocess.run(["pgrep", "-f", "import DEMO_PROMPTS"], capture_output=True, text=True).stdout.split()
        if not found:
            return
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-mixtral")
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", help="a git revision whose auto starts run beside these")
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    caches = Path(tempfile.mkdtemp())
    trees, cases = {}, list(CASES)
    if options.against:
        sys.path.insert(0, str(ROOT / "bench"))
        from compare_commits import worktree

        trees[options.against] = worktree(options.against)
        cases.append(f"auto second {options.against}")
    try:
        for case in cases:  # the second starts' caches: one run each first
            if case.split()[1] == "second":
                run(case, options.model, options.max_tokens, caches, trees)
        runs = {case: [] for case in cases}
        for round_ in range(options.rounds):
            for case in cases if round_ % 2 == 0 else cases[::-1]:
                runs[case].append(run(case, options.model, options.max_tokens, caches, trees))
                print(case, {k: round(v, 2) for k, v in runs[case][-1].items()}, flush=True)
    finally:
        shutil.rmtree(caches, ignore_errors=True)
        for tree in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    table = {case: {key: round(statistics.median(r[key] for r in rs), 2) for key in rs[0]} for case, rs in runs.items()}
    for case, row in table.items():
        print(f"{case:>21}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
    if options.out:
        results = {"machine": machine(), "options": {k: str(v) for k, v in vars(options).items()}, "medians": table,
                   "runs": runs}  # fmt: skip
        options.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
