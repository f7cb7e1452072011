"""Served tokens/s of a model cut across 2 processes (``torchrun ... serve --tensor-parallel 2``) against
the same model in one process, on the same machine (issue 77: the cost of the collectives per step).

Per model and round, in alternation: ``main.py serve`` (one process, as many torch threads as the
machine has cores) and ``torchrun --nproc-per-node 2 main.py serve ... --tensor-parallel 2`` (2 ranks,
torchrun gives each one thread), each started, warmed up with one request, then timed:

Systems: ``one`` (the default ``--decode auto``: on CPU the decode step compiled before serving),
``one_eager`` (``--decode eager``, the steps a cut model runs) and ``two``.

* **1 client**: 4 requests one after another;
* **16 clients**: 16 requests at once (16 rows);

each request a 32-token prompt and exactly ``--max-tokens`` new tokens (``ignore_eos``), greedy.
tokens/s = generated tokens / wall time of the batch of requests. The report is each system's median
over ``--rounds`` and the ratios two/one and two/one_eager per round (medians).

Models: ``tiny-mixtral`` (1.4 M parameters: the per-step costs alone) and ``mid``, a random Mistral-shaped
model (1024 wide, 8 layers, 16 heads, 4 KV heads, hidden 3584; 0.1 G parameters) in float32 with the
shipped tokenizer, written to a temporary folder.

    .venv/bin/python bench/bench_serve_group.py --out bench/results_serve_group.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_speculative import machine  # noqa: E402

SYSTEMS = ("one", "one_eager", "two")
PROMPT = "And the LORD spake unto Moses , saying , Speak unto the children of Israel , and say unto them , When any man of you"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mid_model(folder: Path) -> Path:
    import dataclasses

    import torch

    from mixtral_infer.checkpoint.loading import save_consolidated
    from mixtral_infer.model.transformer import ModelArgs, Transformer

    shipped = ROOT / "mixtral_infer" / "shipped" / "tiny-mistral"
    params = json.loads((shipped / "params.json").read_text())
    args = ModelArgs(**{**params, "dim": 1024, "n_layers": 8, "head_dim": 64, "hidden_dim": 3584, "n_heads": 16,
                        "n_kv_heads": 4, "sliding_window": 256})  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(args, max_batch_size=1))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    save_consolidated(model, folder)
    shutil.copy(shipped / "tokenizer.model", folder / "tokenizer.model")
    return folder


class Served:
    def __init__(self, model: str, group: bool, rows: int, decode: str = "auto"):
        port = free_port()
        serve = ["main.py", "serve", model, "--port", str(port), "--dtype", "float32", "--max-rows", str(rows),
                 "--no-prefix-reuse", "--max-model-len", "4096", "--served-model-name", "m", "--decode", decode]  # fmt: skip
        if group:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                       "--master-port", str(free_port()), *serve, "--tensor-parallel", "2"]  # fmt: skip
        else:
            command = [sys.executable, *serve]
        self.process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        self.port, self.lines, ready = port, [], threading.Event()

        def read():
            for line in self.process.stderr:
                self.lines.append(line)
                if line.startswith("serving "):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300):
            self.stop()
            raise RuntimeError("".join(self.lines))

    def complete(self, max_tokens: int) -> int:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        answer = json.loads(connection.getresponse().read())
        connection.close()
        return answer["usage"]["completion_tokens"]

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def timed(server: Served, clients: int, requests: int, max_tokens: int) -> float:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(lambda _: server.complete(max_tokens), range(requests)))
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-mixtral", "mid"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    results = {"machine": machine(), "options": {k: str(v) for k, v in vars(options).items()}, "models": {}}
    scratch = Path(tempfile.mkdtemp())
    try:
        for name in options.models:
            model = str(mid_model(scratch / "mid")) if name == "mid" else name
            runs = {system: {1: [], 16: []} for system in SYSTEMS}
            for round_ in range(options.rounds):
                for system in SYSTEMS if round_ % 2 == 0 else SYSTEMS[::-1]:
                    server = Served(model, system == "two", rows=16, decode="eager" if system == "one_eager" else "auto")
                    try:
                        server.complete(4)  # warm-up
                        runs[system][1].append(timed(server, 1, 4, options.max_tokens))
                        runs[system][16].append(timed(server, 16, 16, options.max_tokens))
                    finally:
                        server.stop()
                    print(f"{name} round {round_} {system}: 1 client {runs[system][1][-1]:.1f} tok/s, "
                          f"16 clients {runs[system][16][-1]:.1f} tok/s", flush=True)  # fmt: skip
            table = {}
            for clients in (1, 16):
                row = {f"{s}_tok_s": round(statistics.median(runs[s][clients]), 1) for s in SYSTEMS}
                for base in ("one", "one_eager"):
                    ratios = [t / o for t, o in zip(runs["two"][clients], runs[base][clients])]
                    row[f"two_of_{base}"] = round(statistics.median(ratios), 3)
                row["runs"] = {s: [round(v, 1) for v in runs[s][clients]] for s in runs}
                table[str(clients)] = row
                print(f"{name} {clients:>2} clients: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "runs"))
            results["models"][name] = table
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if options.out:
        options.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
