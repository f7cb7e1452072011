"""Load generator: continuous batching (the HTTP server) against static batches through
generate() and against one request at a time, on the same Poisson arrivals.

N requests with ragged prompts and ragged max_tokens arrive as a Poisson process; at most
``--clients`` are in flight at once (a request that arrives when all clients are busy waits
for one, and its wait counts in its latency). Every request generates exactly its max_tokens
(EOS ignored) and each of those tokens is turned into text as it arrives (``TextStream``, as the
server streams it), so all modes do the same work apart from their batching (a static batch's rows
run on to its longest request, and what they compute past their own max_tokens is dropped unread).

- **continuous**: ``main.py serve`` in a subprocess (``--max-rows`` = clients), streamed over
  HTTP on 127.0.0.1 by one thread per client.
- **engine**: the same engine in this process, without HTTP: the scheduling alone, measured
  as the two modes below are.
- **static**: in this process, batches through ``generate()``: when the running batch ends, all
  requests that have arrived (up to ``--clients``) form the next; a batch runs until its longest
  request is done (as a server without continuous batching does).
- **sequential**: in this process, one ``generate()`` per request, in arrival order.
- **engine-grouped** (``--admit-every K``): the engine with prompts admitted in groups.
- **static-compiled**: static batches through ``generate(decode="compiled")``: the baseline with
  the same compiled decode step as ``--decode compiled`` gives the engine and the server.
- **engine-torch-compile**: the engine with its CPU decode step compiled by ``torch.compile``
  instead of built by AOTInductor (``serve.engine.CpuDecodeStep``; paired as ``engine/engine-torch-compile``).

``--decode`` is the server's and the engine's (default ``auto``: compiled on CUDA; on CPU the
static step or ``Transformer.forward`` per step); the static and sequential modes keep
``generate()``'s default.

All modes run with ``--threads`` torch threads (default 1: on a shared machine, a second
thread that waits for a busy core slows small matrix products down by up to 20x).

TTFT: arrival to first token; latency: arrival to last token; throughput: generated tokens over
the time from the first arrival to the last token. The static and sequential modes stream through
``on_token``, so their TTFT and latency are measured the same way, without HTTP's cost.

``--repeat R`` runs every mode R times, all modes in alternation, and reports each
mode's median run (by throughput) with all R throughputs: on a shared virtual machine one run
of the same work varies by up to 30%. The ratios between modes are also given as the median of
each round's ratio (``paired``): the modes of one round run back to back, in the same stretch
of the machine's noise.

``--shape mistral-7b`` (or ``mixtral-8x7b``, the shapes of ``bench_gpu.py``) serves a model of that
shape with random weights built on ``--device`` in ``--dtype``, nothing downloaded: the engine,
static and sequential modes, in process (the server needs a model folder). Its tokenizer is
tiny-mixtral's, with token ids beyond its vocabulary folded into it for detokenization, so every
generated token is still turned into text; so is a ``--model`` folder's without a tokenizer of its
own (the bench shapes of ``bench/llamacpp/``: ``--model /tmp/llama/models/mistral-bench-hf-notok``,
in process). On a GPU::

    python bench/bench_serve.py --shape mistral-7b --device cuda --dtype bfloat16 --requests 128 \
        --rate 10000 --modes engine,static,sequential --repeat 3 --out bench/results_serve_gpu.json
    python bench/bench_serve.py --shape mistral-7b --device cuda --dtype bfloat16 --requests 128 \
        --rate 10000 --modes engine,engine-grouped --compile-prompts off --admit-every 1 --repeat 3 \
        --out bench/results_serve_gpu_prompts_eager.json

(at an expected ~150 tok/s one at a time, the sequential mode's 128 requests of 16-64 tokens take
about 35 s a round: warm-up and 3 rounds take a few minutes). On CUDA
``auto`` is compiled everywhere, so ``static`` is already the like-for-like baseline; the engine
also compiles its steps that read prompts (``Engine``'s ``compile_prompts``) and admits prompts
at every step. The second command measures what that buys: those steps op by op, prompts
admitted every 6 steps (``engine``) or at every step (``engine-grouped`` with ``--admit-every 1``).

With N close to the number of clients, throughput is dominated by the last batch draining (the
longest request of the last group runs alone): ``--requests 384`` (12 per client) measures the
steady state as well.

    .venv/bin/python bench/bench_serve.py --out bench/results_serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mixtral_infer import Tokenizer, generate, load_model  # noqa: E402
from mixtral_infer.generation.text_stream import TextStream  # noqa: E402

TEXT = (
    "And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto them, When any man of you "
    "bring an offering unto the LORD, ye shall bring your offering of the cattle, even of the herd, and of the flock. "
    "If his offering be a burnt sacrifice of the herd, let him offer a male without blemish: he shall offer it of his "
    "own voluntary will at the door of the tabernacle of the congregation before the LORD."
).split()


class FoldedTokenizer(Tokenizer):
    """A tokenizer for a model with a larger vocabulary than its own: ids beyond it are folded
    into it when decoding (``--shape``: random weights generate any of 32000 ids)."""

    def decode(self, ids: List[int]) -> str:
        return super().decode([i % self.n_words for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        return super().id_to_piece(token_id % self.n_words)


def random_model(shape: str, layers, clients: int, device: str, dtype: torch.dtype):
    """``bench_gpu``'s shape with random weights, built on the device (``bench_vs_transformers``'
    initialisation: RMSNorm weights near 1)."""
    from bench_gpu import model_args
    from bench_vs_transformers import _init_

    from mixtral_infer import Transformer

    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Transformer(model_args(shape, layers, clients))
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _init_(name, param)
    return model.eval()


def make_requests(n: int, rate: float, seed: int) -> List[Dict]:
    rng = random.Random(seed)
    arrival, requests = 0.0, []
    for index in range(n):
        arrival += rng.expovariate(rate)
        words = rng.randint(3, 45)
        start = rng.randint(0, len(TEXT) - words)
        requests.append({
            "index": index, "arrival": arrival, "prompt": " ".join(TEXT[start : start + words]),
            "max_tokens": rng.randint(16, 64),
        })  # fmt: skip
    return requests


def percentile(values: List[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summarize(name: str, records: List[Dict], start: float) -> Dict:
    end = max(r["done"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    ttft = [r["first"] - r["arrival"] for r in records]
    latency = [r["done"] - r["arrival"] for r in records]
    result = {
        "mode": name, "requests": len(records), "tokens": tokens, "seconds": end - start,
        "throughput_tok_s": tokens / (end - start),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
    }  # fmt: skip
    print(
        f"{name:>11}: {result['throughput_tok_s']:7.1f} tok/s  TTFT p50 {result['ttft_p50_s'] * 1e3:7.0f} ms "
        f"p99 {result['ttft_p99_s'] * 1e3:7.0f} ms  latency p50 {result['latency_p50_s']:6.2f} s p99 {result['latency_p99_s']:6.2f} s",
        flush=True,
    )
    return result


def median_run(name: str, runs: List[List[Dict]]) -> tuple[Dict, List[Dict]]:
    """The summary of the run with the median throughput (the lower middle one of an even
    count), every run's throughput beside it; and that run's records."""
    summaries = [summarize(name, records, 0.0) for records in runs]
    order = sorted(range(len(runs)), key=lambda i: summaries[i]["throughput_tok_s"])
    middle = order[(len(runs) - 1) // 2]
    summary = dict(
        summaries[middle],
        throughput_runs_tok_s=[s["throughput_tok_s"] for s in summaries],
        ttft_p50_runs_s=[s["ttft_p50_s"] for s in summaries],
    )
    if len(runs) > 1:
        print(f"{name:>11}: median of {len(runs)} runs: {summary['throughput_tok_s']:.1f} tok/s", flush=True)
    return summary, runs[middle]


# ---- continuous batching: the server -----------------------------------------------------


def start_server(model: str, rows: int, prefill_tokens: int, decode: str = "auto", pin_cpus: bool = False):
    command = [sys.executable, "main.py", "serve", model, "--port", "0", "--dtype", "float32", "--max-rows", str(rows),
               "--prefill-tokens", str(prefill_tokens), "--decode", decode] + ["--pin-cpus"] * pin_cpus  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same threads as this process
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.startswith("serving "):
            break
    threading.Thread(target=lambda: [lines.append(x) for x in process.stderr], daemon=True).start()
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)", "".join(lines)).group(1))
    return process, port, lines


def completion_body(request: Dict) -> bytes:
    """The streamed greedy completion every client sends (usage in the last chunk)."""
    return json.dumps({"prompt": request["prompt"], "max_tokens": request["max_tokens"], "temperature": 0,
                       "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()  # fmt: skip


class StreamTimes:
    """Reads a stream's SSE lines: when the first text came, how many tokens in all, when it ended."""

    def __init__(self, clock_start: float):
        self.clock_start, self.first, self.tokens, self.seen = clock_start, None, 0, 0

    def feed(self, line: bytes) -> bool:
        """Take one line; True at ``data: [DONE]``."""
        if not line.startswith(b"data: "):
            return False  # kept cheap: the clients share the 2 cores with the server
        self.seen += 1
        if self.seen == 2:  # the first chunk is the empty opening one; the next carries the first text
            self.first = time.perf_counter() - self.clock_start
        if b'"usage"' in line:
            self.tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return line.startswith(b"data: [DONE]")

    def record(self, request: Dict, **extra) -> Dict:
        done = time.perf_counter() - self.clock_start
        first = self.first if self.first is not None else done
        return {**request, **extra, "first": first, "done": done, "tokens": self.tokens}


def stream_one(port: int, request: Dict, clock_start: float) -> Dict:
    """Send one streamed completion; times are seconds since ``clock_start``."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/completions", completion_body(request), {"Content-Type": "application/json"})
    times = StreamTimes(clock_start)
    for line in connection.getresponse():
        times.feed(line)
    record = times.record(request)
    connection.close()
    return record


class Connections:
    """Open HTTP/1.1 connections to the server, kept alive between requests as the ``openai``
    client's pool keeps them: a request takes an idle one or opens one, and gives it back once
    its response has ended."""

    def __init__(self, port: int):
        self.port, self.idle = port, []

    async def take(self):
        return self.idle.pop() if self.idle else await asyncio.open_connection("127.0.0.1", self.port)

    def give_back(self, connection) -> None:
        self.idle.append(connection)

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


async def stream_async(connections: Connections, request: Dict, clock_start: float) -> Dict:
    """``stream_one`` on asyncio streams: one thread for all clients, so the load generator
    itself stays light beside the server on 2 cores. The SSE lines are read as they come (the
    chunked encoding's size lines are skipped with the rest) up to ``[DONE]``, then the body's
    last (empty) chunk, and the connection goes back to the pool."""
    body = completion_body(request)
    reader, writer = await connections.take()
    sent = time.perf_counter() - clock_start
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    times = StreamTimes(clock_start)
    async for line in reader:
        if times.feed(line):
            break
    record = times.record(request, sent=sent)
    while await reader.readline() != b"0\r\n":  # the end of [DONE]'s chunk, then the last chunk: "0", ""
        pass
    await reader.readline()
    connections.give_back((reader, writer))
    return record


def run_clients(requests: List[Dict], clients: int, port: int, cpus: Optional[List[int]] = None) -> List[Dict]:
    """Replay the arrivals with at most ``clients`` requests in flight; on ``cpus`` if given (with
    ``--pin-cpus``: the server's, as if the clients ran on another machine, off the engine's CPUs)."""
    if cpus is not None:
        everywhere = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)  # this thread, which runs every client
        try:
            return run_clients(requests, clients, port)
        finally:
            os.sched_setaffinity(0, everywhere)

    async def replay():
        slots = asyncio.Semaphore(clients)
        connections = Connections(port)
        start = time.perf_counter()

        async def one(request):
            await asyncio.sleep(max(0.0, request["arrival"] - (time.perf_counter() - start)))
            async with slots:
                return await stream_async(connections, request, start)

        try:
            return await asyncio.gather(*(one(r) for r in requests))
        finally:
            connections.close()

    return asyncio.run(replay())


def idle_ttft(port: int, requests: List[Dict], n: int = 8) -> float:
    """Median time to first token of single requests on an idle server."""
    times = []
    for request in requests[:n]:
        start = time.perf_counter()
        record = stream_one(port, {**request, "arrival": 0.0}, start)
        times.append(record["first"])
    return statistics.median(times)


def server_side_means(port: int) -> Dict[str, float]:
    """Means of the server's own histograms (time to first token, queue wait, latency)."""
    connection = http.client.HTTPConnection("127.0.0.1", port)
    connection.request("GET", "/metrics")
    metrics = connection.getresponse().read().decode()
    means = {}
    for name in ("time_to_first_token_seconds", "queue_wait_seconds", "request_latency_seconds"):
        total = float(re.search(rf"mixtral_infer_{name}_sum (\S+)", metrics).group(1))
        count = float(re.search(rf"mixtral_infer_{name}_count (\S+)", metrics).group(1))
        means[name + "_mean"] = total / count
    return means


# ---- static batches and one at a time, in process ------------------------------------------


def run_generate_batches(model, tokenizer, requests: List[Dict], max_batch: int, decode: str = "auto") -> List[Dict]:
    """Batches of the requests that have arrived when the previous batch ends (up to max_batch),
    each through ``generate(..., decode=decode)``."""
    pending, records = list(requests), []
    start = time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        if pending[0]["arrival"] > now:
            time.sleep(pending[0]["arrival"] - now)
            now = pending[0]["arrival"]
        batch = [r for r in pending if r["arrival"] <= now][:max_batch]
        pending = pending[len(batch) :]
        firsts: Dict[int, float] = {}
        lasts: Dict[int, float] = {}
        counts = [0] * len(batch)
        texts = [TextStream(tokenizer, leading_space=True) for _ in batch]

        def on_token(i, token, batch=batch, firsts=firsts, lasts=lasts, counts=counts, texts=texts):
            if counts[i] == batch[i]["max_tokens"]:
                return  # the row runs on for the batch's longest request; a server would stream nothing more
            texts[i].push(token)
            counts[i] += 1
            t = time.perf_counter() - start
            firsts.setdefault(i, t)
            if counts[i] == batch[i]["max_tokens"]:
                lasts[i] = t

        generate(
            [tokenizer.encode(r["prompt"]) for r in batch], model, max_tokens=max(r["max_tokens"] for r in batch),
            temperature=0.0, on_token=on_token, prompt_logprobs=False, decode=decode,
        )  # fmt: skip
        for i, request in enumerate(batch):
            records.append({**request, "first": firsts[i], "done": lasts[i], "tokens": request["max_tokens"]})
    return records


def run_engine_in_process(
    model, tokenizer, requests: List[Dict], clients: int, prefill_tokens: int, admit_every: Optional[int] = None,
    decode: str = "auto", compile_prompts: Optional[bool] = None, tuning=None,
) -> List[Dict]:
    """Continuous batching without HTTP: the engine's thread, requests submitted at their arrivals;
    the engine's steps built as ``tuning`` says (None: the model's)."""
    from mixtral_infer.serve.engine import Engine, Finished, RequestSettings

    # A model without a window (Mixtral 8x7B) sizes its rows by the longest request: prompt + max_tokens.
    longest = max(len(tokenizer.encode(r["prompt"])) + r["max_tokens"] for r in requests)
    engine = Engine(
        model, tokenizer, rows=clients, prefill_tokens=prefill_tokens, max_queue=len(requests), admit_every=admit_every,
        decode=decode, compile_prompts=compile_prompts,
        max_model_len=None if model.args.sliding_window is not None else longest, tuning=tuning,
    )  # fmt: skip
    engine.start()
    slots = threading.Semaphore(clients)
    records: List[Dict] = []
    everything_done = threading.Event()
    start = time.perf_counter()

    def sink_for(request):
        record = {**request, "first": None, "tokens": 0}

        def sink(event):
            now = time.perf_counter() - start
            if isinstance(event, Finished):
                record["done"] = now
                records.append(record)
                slots.release()
                if len(records) == len(requests):
                    everything_done.set()
                return
            record["tokens"] += 1
            if record["first"] is None:
                record["first"] = now

        return sink

    for request in requests:
        delay = request["arrival"] - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        slots.acquire()
        settings = RequestSettings(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
        engine.submit(tokenizer.encode(request["prompt"]), settings, sink_for(request))
    everything_done.wait()
    engine.shutdown()
    return records


def without_aot(model):
    """``model``'s tuning with the CPU decode steps compiled by torch.compile, not built by AOTInductor."""
    import dataclasses

    from mixtral_infer.formats.modules import tuning_of

    return dataclasses.replace(tuning_of(model), ahead_of_time=False)


def paired_ratios(throughputs: Dict[str, List[float]]) -> Dict[str, float]:
    """``{"engine/static": x, ...}``: for each pair of a batching mode and a baseline, the median
    over rounds of that round's throughput ratio.

    >>> paired_ratios({"engine": [300, 200], "static": [100, 200]})
    {'engine/static': 2.0}
    """
    ratios = {}
    for mode in ("continuous", "engine", "engine-grouped"):
        for base in ("static", "static-compiled", "sequential", "engine-torch-compile"):
            if mode in throughputs and base in throughputs:
                pairs = zip(throughputs[mode], throughputs[base])
                ratios[f"{mode}/{base}"] = statistics.median(a / b for a, b in pairs)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-mixtral")
    parser.add_argument("--shape", default=None, help="mistral-7b or mixtral-8x7b: random weights of that shape")
    parser.add_argument("--layers", type=int, default=None, help="with --shape: this many layers")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--rate", type=float, default=40.0, help="Poisson arrival rate, requests per second")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes",
        default="continuous,engine,static,sequential",
        help="also engine-grouped, static-compiled, engine-torch-compile",
    )
    parser.add_argument("--decode", default="auto", help="the server's and the engine's --decode (static: generate's default)")
    parser.add_argument("--admit-every", type=int, default=8, help="engine-grouped: steps between prompt groups")
    parser.add_argument("--compile-prompts", default="auto", choices=["auto", "on", "off"],
                        help="the in-process engine's compile_prompts (auto: on CUDA with a compiled decode step)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, here and in the server")
    parser.add_argument("--pin-cpus", action="store_true", help="serve --pin-cpus, and the clients on the server's CPU")
    parser.add_argument("--repeat", type=int, default=1, help="runs per mode; the median run is reported")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default: 1 where a mode compiles)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    if args.shape is not None and "continuous" in modes:
        parser.error("--shape serves random weights in process: leave 'continuous' out of --modes (the server needs a folder)")

    requests = make_requests(args.requests, args.rate, args.seed)
    load_before = os.getloadavg()
    results = {
        "model": args.shape or args.model, "layers": args.layers, "device": args.device, "dtype": args.dtype,
        "requests": args.requests, "clients": args.clients, "rate_per_s": args.rate,
        "max_tokens": "16..64 (uniform)", "prompt_words": "3..45 (uniform)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
        + (f", {torch.cuda.get_device_name(args.device)}" if args.device.startswith("cuda") else ""),
        "decode": args.decode, "compile_prompts": args.compile_prompts, "pin_cpus": args.pin_cpus, "repeat": args.repeat, "load_average_before": load_before, "modes": [],
    }  # fmt: skip
    in_process, process = {}, None
    if {"engine", "engine-grouped", "engine-torch-compile", "static", "static-compiled", "sequential"} & set(modes):
        dtype = getattr(torch, args.dtype)
        if args.shape is not None:
            model = random_model(args.shape, args.layers, args.clients, args.device, dtype)
            tokenizer = FoldedTokenizer.from_folder("tiny-mixtral")
        else:
            model = load_model(args.model, dtype=dtype, device=args.device, max_batch_size=args.clients)
            folded = Path(args.model).is_dir() and not (Path(args.model) / "tokenizer.model").exists()
            tokenizer = (FoldedTokenizer if folded else Tokenizer).from_folder("tiny-mixtral" if folded else args.model)
        generate([tokenizer.encode("warm up")], model, max_tokens=4)
        compile_prompts = {"auto": None, "on": True, "off": False}[args.compile_prompts]
        in_process = {
            "engine": lambda: run_engine_in_process(
                model, tokenizer, requests, args.clients, args.prefill_tokens, None, args.decode, compile_prompts
            ),
            "engine-grouped": lambda: run_engine_in_process(
                model, tokenizer, requests, args.clients, args.prefill_tokens, args.admit_every, args.decode, compile_prompts
            ),
            "engine-torch-compile": lambda: run_engine_in_process(
                model, tokenizer, requests, args.clients, args.prefill_tokens, None, args.decode, compile_prompts,
                without_aot(model),
            ),
            "static": lambda: run_generate_batches(model, tokenizer, requests, args.clients),
            "static-compiled": lambda: run_generate_batches(model, tokenizer, requests, args.clients, decode="compiled"),
            "sequential": lambda: run_generate_batches(model, tokenizer, requests, 1),
        }
    try:
        runners = {mode: in_process[mode] for mode in in_process if mode in modes}
        if "continuous" in modes:
            process, port, lines = start_server(args.model, args.clients, args.prefill_tokens, args.decode, args.pin_cpus)
            stream_one(port, requests[0], time.perf_counter())  # warm-up
            results["idle_ttft_s"] = idle_ttft(port, requests)
            print(f"idle server TTFT (median of 8): {results['idle_ttft_s'] * 1e3:.0f} ms", flush=True)
            from mixtral_infer.serve.engine_process import split_cpus

            split = split_cpus(sorted(os.sched_getaffinity(0))) if args.pin_cpus else None
            client_cpus = split[0] if split is not None else None
            runners = {"continuous": lambda: run_clients(requests, args.clients, port, client_cpus), **runners}
        compiles = args.device.startswith("cuda") or args.decode == "compiled" or "static-compiled" in modes
        warmup = args.warmup if args.warmup is not None else int(compiles)
        for _ in range(warmup):  # compiles every shape the timed rounds use
            for mode, runner in runners.items():
                runner()
        runs: Dict[str, list] = {mode: [] for mode in runners}
        throughputs: Dict[str, List[float]] = {}
        for _ in range(args.repeat):  # alternating, so a noisy stretch of time hits every mode
            for mode, runner in runners.items():
                runs[mode].append(runner())
        for mode in runners:
            summary, records = median_run(mode, runs[mode])
            results["modes"].append(summary)
            throughputs[mode] = summary["throughput_runs_tok_s"]
            if mode == "continuous":
                late = [r["sent"] - r["arrival"] for r in records]
                from_sent = [r["first"] - r["sent"] for r in records]
                results["continuous_send_delay_p50_s"] = percentile(late, 50)
                results["continuous_ttft_from_send_p50_s"] = percentile(from_sent, 50)
                print(f"  sent after arrival p50 {percentile(late, 50) * 1e3:.0f} ms; TTFT from sending p50 {percentile(from_sent, 50) * 1e3:.0f} ms")
        if process is not None:
            results["server_side"] = server_side_means(port)
            print("server side (mean, all requests incl. warm-up):", {k: round(v, 4) for k, v in results["server_side"].items()})
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    results["load_average_after"] = os.getloadavg()
    results["paired"] = paired_ratios(throughputs)
    for name, ratio in results["paired"].items():
        print(f"paired (median of the rounds' ratios): {name} {ratio:.2f}x")
    by_mode = {m["mode"]: m for m in results["modes"]}
    if {"engine", "static", "sequential"} <= set(by_mode):
        e = by_mode["engine"]["throughput_tok_s"]
        results["engine_vs_sequential"] = e / by_mode["sequential"]["throughput_tok_s"]
        results["engine_vs_static"] = e / by_mode["static"]["throughput_tok_s"]
        print(f"in process: engine / sequential {results['engine_vs_sequential']:.2f}x, engine / static {results['engine_vs_static']:.2f}x")
    if {"continuous", "static", "sequential"} <= set(by_mode):
        c = by_mode["continuous"]["throughput_tok_s"]
        results["continuous_vs_sequential"] = c / by_mode["sequential"]["throughput_tok_s"]
        results["continuous_vs_static"] = c / by_mode["static"]["throughput_tok_s"]
        print(
            f"continuous / sequential {results['continuous_vs_sequential']:.2f}x, continuous / static "
            f"{results['continuous_vs_static']:.2f}x"
        )
    if "continuous" in by_mode:
        # The median over runs of each run's p50: the median-throughput run's own p50 is one draw.
        ttft = statistics.median(by_mode["continuous"]["ttft_p50_runs_s"])
        results["ttft_p50_vs_idle"] = ttft / results["idle_ttft_s"]
        print(f"continuous TTFT p50 (median of the runs' p50s) {ttft * 1e3:.1f} ms = {results['ttft_p50_vs_idle']:.2f}x idle")
    print(f"load average before {load_before}, after {results['load_average_after']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        from plots import plot_after_run  # bench/plots.py: the plot beside the JSON

        plot_after_run("serve", args.out)


if __name__ == "__main__":
    main()
