"""Benchmark mixtral_infer against Hugging Face transformers on the same random weights.

Run (about 15 minutes on 2 CPU cores, peak ~8 GB of RAM)::

    python bench/bench_vs_transformers.py --out bench/results.json

Two models are built in float32 on the CPU with random weights, and the SAME weights are loaded into
``transformers.MixtralForCausalLM`` / ``MistralForCausalLM`` (default attention implementation, sdpa,
and default experts implementation) and into ours (``hf_to_published`` + ``checkpoint.build_model``):

* ``mixtral-bench``: dim 1024, 8 layers, 16 heads, 4 KV heads, head_dim 64, hidden 3584, 8 experts
  top-2, vocab 32000, sliding window 256 (3.2 GB of weights);
* ``mistral-bench``: the same with a dense SwiGLU of hidden 3584 instead of the experts (0.7 GB).

(``SHAPES`` also has ``mistral-wide``, Mistral 7B's widths with 4 layers, and ``ministral-wide``, Ministral
8B's with 4 layers, for the llama.cpp harness.)

Weights: embeddings N(0, 1), every matrix N(0, 1/fan_in), norms U(0.8, 1.2), so activations stay
O(1) through the layers and the logits (std ~1 over 32000 tokens) make greedy ties very unlikely.

What is measured, in one process unless said otherwise:

1. Decode throughput, batch 1 and 8: random 64-token prompts, 128 greedy new tokens. Only the
   decode loop is timed; the prefill before it is not. Both sides do exactly the same work per step:
   one forward of the model over the B last tokens with the KV cache, then ``argmax`` of the
   ``(B, V)`` logits.

   * ours: ``generate.prefill`` over the prompts (default chunk, last logits only, as ``generate``
     does, into the cache ``generate`` would make: ``make_cache(B, max_seqlen=64 + 128)``), then the timed loop
     ``logits = model(tokens, [1] * B, cache); tokens = logits.argmax(-1)``. This is ``generate()``'s
     loop without its per-step bookkeeping (log-softmax of the logits for the returned log-probs,
     the finiteness check, ``.tolist()``); that bookkeeping is measured separately and reported as
     ``ours_generate_overhead_ms``.
   * transformers: ``out = model(prompts, use_cache=True)`` (a ``DynamicCache`` built from the
     config: sliding-window layers), then the timed loop
     ``out = model(tokens[:, None], past_key_values=out.past_key_values, use_cache=True)``;
     ``tokens = out.logits[:, -1].argmax(-1)``. ``model.generate`` is not used: its logits
     processors, stopping criteria and prefill would all land on transformers' side of the scale.

   The prompts are of equal length, so transformers needs no padding / attention mask. Each timed
   run starts from a fresh prefill; one warm-up run, then the median of ``--repeats`` runs, ours
   and transformers alternating so that a drift of the machine hits both (fewer runs, at least one,
   when they would take longer than ``--budget`` seconds per side). tokens/s = B * 128 /
   seconds. The greedy tokens of both must be equal: the first index where they differ is reported.

2. Prefill throughput of one 2048-token prompt (8 x the window), into a window-sized cache for
   ours, in one ``model(prompt, use_cache=True)`` for transformers. Three rows, each the median of
   ``--repeats`` runs after a warm-up, ours and transformers alternating:

   * last logit, ours with the default chunk (``generate.default_chunk_size(1)`` = 2048 tokens):
     what generation does. Ours ``generate.prefill`` (last logits only), transformers
     ``logits_to_keep=1`` (as ``hf.generate`` does);
   * the same with ours in chunks of the window (256): less activation memory, smaller matmuls;
   * all logits, ours with the default chunk: every prompt token's logits on both sides (scoring).

3. KV-cache bytes and peak resident memory for a context of 1x, 4x and 16x the window (batch 1).
   Each measurement runs in its own subprocess that builds only the model it needs, runs a small
   warm-up forward, resets the peak (``echo 5 > /proc/self/clear_refs``), reads VmRSS as the
   baseline, then prefills the context as generation does (the first row of 2.: ours in chunks of
   2048 tokens, last logit only on both sides; ``ours-window``: ours in chunks of the window) and
   decodes 4 tokens; peak = VmHWM minus
   the baseline (weights and library buffers excluded). Cache bytes:
   ours ``cache.nbytes()`` (the whole rotating buffer); transformers the bytes of the tensors its
   ``DynamicCache`` holds (``nbytes``) and of the storages behind them: transformers 5's
   ``DynamicSlidingWindowLayer`` keeps the last ``window - 1`` positions as a *view* of the full
   concatenated keys/values, so right after a long prefill the whole context stays allocated until
   the next decode step replaces it.

4. Memory bandwidth and the decode ceiling: read bandwidth = best of 7 ``torch.sum`` over a 1.5 GB
   float32 tensor, read before and after every timed batch-1 decode run (this shared machine's
   bandwidth drifts over minutes, 38 to 76 GB/s seen); each run is set against the higher of the
   two readings beside it, so the ceiling is never flattering, and the median is reported; bytes
   one decode step must read at batch 1 = one embedding row + per layer (2 norms, wq/wk/wv/wo,
   the router and the 2 chosen experts, or the dense FFN) + final norm + the output matrix (the
   KV cache read, < 2 MB here, is left out). Ceiling tokens/s = bandwidth / bytes,
   and ours at batch 1 is reported as a fraction of it.

It prints a table and writes the same figures as JSON (``--out``), with the machine description.
``--quick`` runs a much shorter version (for smoke tests; its numbers mean little).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import torch

from mixtral_infer import ModelArgs, MoeArgs, Transformer
from mixtral_infer.checkpoint.hf_format import hf_to_published
from mixtral_infer.checkpoint.loading import build_model
from mixtral_infer.checkpoint.params import args_to_params
from mixtral_infer.formats.measured import machine_tuning
from mixtral_infer.formats.modules import use_formats
from mixtral_infer.formats.packing import blocked_numel, packed_numel
from mixtral_infer.generation.generate import default_chunk_size
from mixtral_infer.generation.generate import prefill as ours_prefill

WINDOW = 256
PROMPT_LEN = 64
NEW_TOKENS = 128
PREFILL_LEN = 2048
CONTEXTS = (1, 4, 16)  # x the window
MODELS = ("mixtral-bench", "mistral-bench")  # what this benchmark runs by default
_BENCH = dict(dim=1024, head_dim=64, hidden_dim=3584, n_heads=16, n_kv_heads=4, n_layers=8)
SHAPES = {
    "mixtral-bench": dict(_BENCH, moe=True),
    "mistral-bench": dict(_BENCH, moe=False),
    # Mistral 7B's widths (its layers read 0.22 G weights each) but 4 of its 32 layers: a decode
    # step's fixed costs weigh here as on the real model, and it fits this machine in float32.
    "mistral-wide": dict(dim=4096, head_dim=128, hidden_dim=14336, n_heads=32, n_kv_heads=8, n_layers=4, moe=False),
    # Mixtral 8x7B's widths (8 experts of Mistral 7B's feed-forward) with 2 of its 32 layers.
    "mixtral-wide": dict(dim=4096, head_dim=128, hidden_dim=14336, n_heads=32, n_kv_heads=8, n_layers=2, moe=True),
    # Ministral 8B's widths (hidden 12288, vocab 131072, rope_theta 1e8) with 4 of its 36 layers in its
    # pattern: one full-attention layer, three windowed (window 4096, not its 32768, so that an
    # 8192-token prompt runs past it). bench/llamacpp/run_ministral.py.
    "ministral-wide": dict(dim=4096, head_dim=128, hidden_dim=12288, n_heads=32, n_kv_heads=8, n_layers=4, moe=False,
                           vocab_size=131072, rope_theta=1e8, sliding_window=[None, 4096, 4096, 4096]),
}


# --------------------------------------------------------------------------- models


def bench_args(name: str, max_batch_size: int = 8, n_layers: Optional[int] = None) -> ModelArgs:
    """The shape ``name`` (``SHAPES``) with ``n_layers`` layers (default: the shape's own)."""
    if name not in SHAPES:
        raise ValueError(f"unknown model {name!r}; choose from {tuple(SHAPES)}")
    shape = dict(SHAPES[name])
    moe = MoeArgs(num_experts=8, num_experts_per_tok=2) if shape.pop("moe") else None
    if n_layers is not None:
        shape["n_layers"] = n_layers
    shape = {"vocab_size": 32000, "sliding_window": WINDOW, **shape}  # unless the shape has its own
    return ModelArgs(**shape, norm_eps=1e-5, max_batch_size=max_batch_size, moe=moe)


def _init_(name: str, param: torch.Tensor) -> None:
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        param.uniform_(0.8, 1.2)
    elif "embed" in name or "tok_embeddings" in name:
        param.normal_(0.0, 1.0)
    else:
        param.normal_(0.0, param.shape[-1] ** -0.5)  # fan_in is the last dim of every matrix here


def hf_model(args: ModelArgs, seed: int = 0):
    """A transformers model with random float32 weights (default attention / experts implementations)."""
    import transformers

    common = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        sliding_window=args.sliding_window,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    windows = args.layer_windows
    if len(set(windows)) > 1:  # full-attention layers beside windowed ones (ministral-wide)
        common.update(sliding_window=next(w for w in windows if w is not None),
                      layer_types=["full_attention" if w is None else "sliding_attention" for w in windows])  # fmt: skip
        config, cls = transformers.MinistralConfig(**common), transformers.MinistralForCausalLM
    elif args.moe is None:
        config, cls = transformers.MistralConfig(**common), transformers.MistralForCausalLM
    else:
        config = transformers.MixtralConfig(
            num_local_experts=args.moe.num_experts, num_experts_per_tok=args.moe.num_experts_per_tok, **common
        )
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(config).float()  # built on the CPU: its rotary buffers must be real
    with torch.no_grad():
        for name, param in model.named_parameters():
            _init_(name, param)
    return model.eval()


def ours_from_hf(hf, args: ModelArgs) -> Transformer:
    """The same weights in ours, with the fast modules this machine's tuning gives, as load_model does."""
    tensors = hf_to_published(hf.state_dict().items(), args)
    return use_formats(build_model(args, tensors, "transformers", device="cpu", dtype=torch.float32), machine_tuning(floats=True))


def ours_alone(args: ModelArgs, seed: int = 0) -> Transformer:
    """Our model with random weights, without building transformers' (memory subprocesses)."""
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device="cpu")  # no buffers: every tensor is a parameter, initialised below
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _init_(name, param)
    return use_formats(model, machine_tuning(floats=True)).eval()


# --------------------------------------------------------------------------- machine


def machine_info() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    try:
        mem_kb = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration):
        mem_kb = 0
    repo = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "mixtral_infer"], cwd=repo, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit, dirty = "", ""
    return {
        "git_commit": commit or None,
        "package_modified_since_commit": bool(dirty),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "mem_total_gb": round(mem_kb / 2**20, 1),
        "dtype": "float32",
    }


def other_busy_processes() -> List[str]:
    """Other processes using a CPU right now (e.g. a training run), from ps."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--no-headers"], capture_output=True, text=True).stdout
    except OSError:
        return []
    busy = []
    for line in out.splitlines():
        pid, pcpu, cmd = line.strip().split(None, 2)
        if int(pid) != os.getpid() and float(pcpu) > 20 and "ps -eo" not in cmd:
            busy.append(f"{pid} {pcpu}% {cmd[:100]}")
    return busy


class CpuWatcher:
    """Samples, every few seconds, which processes outside this benchmark use the CPU.

    The machine is shared: a test run or a training job started by someone else during the
    benchmark slows both sides and, worse, makes 2-thread OpenMP runs stall at every barrier.
    The report says whether (and by what) each run was disturbed.
    """

    def __init__(self, interval: float = 5.0, threshold: float = 0.2):
        import threading

        self.interval, self.threshold = interval, threshold
        self.samples = 0
        self.busy_samples = 0
        self.offenders: Dict[str, float] = {}  # command -> highest share of one core seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _snapshot() -> Dict[int, tuple]:
        table = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                rest = stat[stat.rindex(")") + 2 :].split()
                ppid, ticks = int(rest[1]), int(rest[11]) + int(rest[12])
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                table[int(entry)] = (ppid, ticks, cmd or stat[stat.index("(") : stat.rindex(")") + 1])
            except (OSError, ValueError, IndexError):
                continue
        return table

    def _ours(self, table: Dict[int, tuple]) -> set:
        ours, changed = {os.getpid()}, True
        while changed:
            changed = False
            for pid, (ppid, _, _) in table.items():
                if ppid in ours and pid not in ours:
                    ours.add(pid)
                    changed = True
        return ours

    def _run(self) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        before, t0 = self._snapshot(), time.monotonic()
        while not self._stop.wait(self.interval):
            after, t1 = self._snapshot(), time.monotonic()
            ours = self._ours(after)
            busy = False
            for pid, (_, ticks, cmd) in after.items():
                if pid in ours or pid not in before:
                    continue
                share = (ticks - before[pid][1]) / hz / (t1 - t0)
                if share > self.threshold:
                    busy = True
                    self.offenders[cmd[:120]] = max(self.offenders.get(cmd[:120], 0.0), round(share, 2))
            self.samples += 1
            self.busy_samples += busy
            before, t0 = after, t1

    def start(self) -> "CpuWatcher":
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"samples": self.samples, "busy_samples": self.busy_samples, "offenders": self.offenders}


def read_bandwidth(gigabytes: float = 1.5, repeats: int = 7) -> float:
    """Best-of-N read bandwidth (bytes/s) of a float32 sum over a large tensor."""
    # Random data, not ones: pages of identical bytes can be deduplicated by the host and read from cache.
    x = torch.rand(int(gigabytes * 2**30) // 4, dtype=torch.float32)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    nbytes = x.nbytes
    del x
    return nbytes / best


def ceiling_fractions(decode: dict, step_bytes: int) -> dict:
    """Each timed batch-1 run as a fraction of the ceiling set by the bandwidth read around it.

    The higher of the two readings around a run is used, so the ceiling is never flattering;
    the medians over the runs are reported.
    """
    readings, n = decode["bandwidth_gb_s_around_runs"], decode["new_tokens"]

    def fractions(times: List[float], first: int) -> List[float]:
        return [
            (n / t) / (max(readings[first + 2 * i], readings[first + 2 * i + 1]) * 1e9 / step_bytes)
            for i, t in enumerate(times)
        ]

    ours, hf = fractions(decode["ours_runs_s"], 0), fractions(decode["hf_runs_s"], 1)
    return {
        "bandwidth_gb_s": statistics.median(readings),
        "bandwidth_gb_s_range": [min(readings), max(readings)],
        "tok_s_b1": statistics.median(readings) * 1e9 / step_bytes,
        "ours_fraction_b1_runs": ours,
        "hf_fraction_b1_runs": hf,
        "ours_fraction_b1": statistics.median(ours),
        "hf_fraction_b1": statistics.median(hf),
    }


def decode_bytes(model: Transformer, batch: int = 1) -> dict:
    """Bytes of weights one decode step reads: exact at batch 1, expected (uniform routing) at batch B."""
    args = model.args
    size = model.dtype.itemsize
    layers = list(model.layers.values()) if isinstance(model.layers, torch.nn.ModuleDict) else list(model.layers)
    layer = layers[0]
    held_apart = packed_numel(layer.attention) + blocked_numel(layer.attention)  # not in parameters()
    attention = sum(p.numel() for p in layer.attention.parameters()) + held_apart
    norms = layer.attention_norm.weight.numel() + layer.ffn_norm.weight.numel()
    if args.moe is not None:
        ff = layer.feed_forward
        one_expert = ff.w1[0].numel() + ff.w2[0].numel() + ff.w3[0].numel()
        n, k = args.moe.num_experts, args.moe.num_experts_per_tok
        distinct = n * (1 - (1 - k / n) ** batch)  # expected distinct experts among B tokens
        ffn = ff.gate.weight.numel() + distinct * one_expert
    else:
        held_apart = packed_numel(layer.feed_forward) + blocked_numel(layer.feed_forward)  # not in parameters()
        ffn = sum(p.numel() for p in layer.feed_forward.parameters()) + held_apart
    per_layer = attention + norms + ffn
    total = batch * args.dim + len(layers) * per_layer + args.dim + model.output.weight.numel()
    return {"bytes": int(total * size), "per_layer": int(per_layer * size), "output": model.output.weight.numel() * size}


# --------------------------------------------------------------------------- decode


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


@torch.inference_mode()
def ours_decode(model: Transformer, prompts: List[List[int]], new_tokens: int) -> tuple[float, List[List[int]]]:
    batch = len(prompts)
    cache = model.make_cache(batch, max_seqlen=len(prompts[0]) + new_tokens)
    cache.start_sequences(batch)
    logits = ours_prefill(model, cache, prompts, default_chunk_size(len(prompts)))
    tokens = logits.argmax(-1)
    out = [tokens]
    seqlens = [1] * batch
    start = time.perf_counter()
    for _ in range(new_tokens):
        logits = model(tokens, seqlens, cache)
        tokens = logits.argmax(-1)
        out.append(tokens)
    seconds = time.perf_counter() - start
    return seconds, torch.stack(out, 1).tolist()


@torch.inference_mode()
def hf_decode(hf, prompts: List[List[int]], new_tokens: int) -> tuple[float, List[List[int]]]:
    result = hf(torch.tensor(prompts), use_cache=True)
    past = result.past_key_values
    tokens = result.logits[:, -1].argmax(-1)
    del result
    out = [tokens]
    start = time.perf_counter()
    for _ in range(new_tokens):
        result = hf(tokens[:, None], past_key_values=past, use_cache=True)
        past = result.past_key_values
        tokens = result.logits[:, -1].argmax(-1)
        out.append(tokens)
    seconds = time.perf_counter() - start
    return seconds, torch.stack(out, 1).tolist()


@torch.inference_mode()
def ours_generate_overhead(model: Transformer, batch: int, repeats: int = 200) -> float:
    """Per-step ms of generate()'s bookkeeping that the timed loop leaves out (log-softmax, checks, tolist)."""
    from mixtral_infer.generation.generate import _check_finite
    from mixtral_infer.sampling import sample_next

    logits = torch.randn(batch, model.args.vocab_size)
    start = time.perf_counter()
    for _ in range(repeats):
        tokens = sample_next(logits, 0.0)
        lp = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
        tokens.tolist(), lp.tolist()
        torch.tensor(tokens.tolist(), dtype=torch.long)
        _check_finite(logits, "")
    return (time.perf_counter() - start) / repeats * 1e3


def first_difference(a: List[List[int]], b: List[List[int]]) -> Optional[int]:
    """First step at which any sequence differs (None when all equal)."""
    steps = [next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None) for ra, rb in zip(a, b)]
    steps = [s for s in steps if s is not None]
    return min(steps) if steps else None


def affordable_repeats(repeats: int, seconds_per_run: float, budget: float) -> int:
    """Fewer timed runs (at least 1) when ``repeats`` runs would take longer than ``budget`` seconds."""
    return max(1, min(repeats, int(budget // max(seconds_per_run, 1e-9))))


def bench_decode(ours, hf, args: ModelArgs, batch: int, repeats: int, new_tokens: int, budget: float, log) -> dict:
    prompts = random_prompts(batch, PROMPT_LEN, args.vocab_size, seed=1000 + batch)
    warm = min(new_tokens, 16)
    ours_warm, _ = ours_decode(ours, prompts, warm)  # warm-up, and an estimate of the time per step
    hf_warm, _ = hf_decode(hf, prompts, warm)
    repeats = affordable_repeats(repeats, max(ours_warm, hf_warm) / warm * new_tokens, budget)
    ours_times, hf_times = [], []
    # Batch 1 is judged against the bandwidth ceiling: read the bandwidth right before and after
    # each timed run, since this machine's bandwidth drifts over minutes (38 to 76 GB/s seen).
    readings = [read_bandwidth() / 1e9] if batch == 1 else []
    for _ in range(repeats):
        t, ours_tokens = ours_decode(ours, prompts, new_tokens)
        ours_times.append(t)
        if batch == 1:
            readings.append(read_bandwidth() / 1e9)
        t, hf_tokens = hf_decode(hf, prompts, new_tokens)
        hf_times.append(t)
        if batch == 1:
            readings.append(read_bandwidth() / 1e9)
    ours_s, hf_s = statistics.median(ours_times), statistics.median(hf_times)
    diff = first_difference(ours_tokens, hf_tokens)
    result = {
        "batch": batch,
        "new_tokens": new_tokens,
        "ours_tok_s": batch * new_tokens / ours_s,
        "hf_tok_s": batch * new_tokens / hf_s,
        "ours_ms_per_step": ours_s / new_tokens * 1e3,
        "hf_ms_per_step": hf_s / new_tokens * 1e3,
        "ours_runs_s": ours_times,
        "hf_runs_s": hf_times,
        "timed_runs": repeats,
        # run i of ours lies between readings 2i and 2i+1, run i of transformers between 2i+1 and 2i+2
        "bandwidth_gb_s_around_runs": readings,
        "speedup": hf_s / ours_s,
        "greedy_tokens_equal": diff is None,
        "first_divergence_step": diff,
        "ours_generate_overhead_ms": ours_generate_overhead(ours, batch),
    }
    log(
        f"  decode b{batch}: ours {result['ours_tok_s']:.1f} tok/s, transformers {result['hf_tok_s']:.1f} tok/s "
        f"(x{result['speedup']:.2f}); greedy equal: {diff is None}"
    )
    return result


# --------------------------------------------------------------------------- prefill


@torch.inference_mode()
def ours_chunked_prefill(model: Transformer, prompt: List[int], chunk: int, all_logits: bool = False):
    """Prefill one prompt in chunks into a window-sized cache; returns (last logits, cache).

    ``all_logits``: every chunk computes the logits of all its tokens (as for scoring);
    otherwise only the prompt's last token goes through the output matrix, as ``generate``
    does with ``prompt_logprobs=False``.
    """
    cache = model.make_cache(1)
    cache.start_sequences(1)
    if not all_logits:
        logits = ours_prefill(model, cache, [prompt], chunk)
        return logits[0], cache
    ids = torch.tensor(prompt, dtype=torch.long)
    logits = None
    for start in range(0, len(prompt), chunk):
        piece = ids[start : start + chunk]
        logits = model(piece, [len(piece)], cache)
    return logits[-1], cache


@torch.inference_mode()
def hf_full_prefill(hf, prompt: List[int], all_logits: bool = False):
    """One forward over the whole prompt; ``logits_to_keep=1`` (as ``hf.generate`` does) unless ``all_logits``."""
    result = hf(torch.tensor([prompt]), use_cache=True, logits_to_keep=0 if all_logits else 1)
    return result.logits[0, -1], result.past_key_values


def bench_prefill(ours, hf, args: ModelArgs, length: int, repeats: int, budget: float, log) -> List[dict]:
    """Rows: (ours chunk, logits) for the default chunk and for chunk = window, last logit and all logits."""
    prompt = random_prompts(1, length, args.vocab_size, seed=7)[0]
    default_chunk = default_chunk_size(1)
    window = args.sliding_window or length
    cases = [(default_chunk, False), (window, False), (default_chunk, True)]
    ours_chunked_prefill(ours, prompt[:window], window)  # warm-up
    hf_full_prefill(hf, prompt[:window])
    start = time.perf_counter()
    hf_full_prefill(hf, prompt)  # an estimate of the time per run
    run_s = time.perf_counter() - start
    repeats = affordable_repeats(repeats, run_s, budget)
    rows = []
    for chunk, all_logits in cases:
        ours_times, hf_times = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            ours_last, _ = ours_chunked_prefill(ours, prompt, chunk, all_logits)
            ours_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            hf_last, _ = hf_full_prefill(hf, prompt, all_logits)
            hf_times.append(time.perf_counter() - start)
        ours_s, hf_s = statistics.median(ours_times), statistics.median(hf_times)
        row = {
            "tokens": length,
            "chunk": min(chunk, length),
            "default_chunk": chunk == default_chunk,
            "logits": "all" if all_logits else "last",
            "ours_tok_s": length / ours_s,
            "hf_tok_s": length / hf_s,
            "ours_runs_s": ours_times,
            "hf_runs_s": hf_times,
            "timed_runs": repeats,
            "speedup": hf_s / ours_s,
            "last_logits_max_abs_diff": (ours_last - hf_last).abs().max().item(),
            "same_argmax": int(ours_last.argmax()) == int(hf_last.argmax()),
        }
        log(
            f"  prefill {length} ({row['logits']} logits, ours chunk {row['chunk']}): ours {row['ours_tok_s']:.0f} "
            f"tok/s, transformers {row['hf_tok_s']:.0f} tok/s (x{row['speedup']:.2f}); "
            f"last-logit diff {row['last_logits_max_abs_diff']:.2e}"
        )
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- memory (subprocess)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def hf_cache_bytes(past) -> dict:
    tensor_bytes, storages = 0, {}
    for layer in past.layers:
        for t in (layer.keys, layer.values):
            if t is None or not isinstance(t, torch.Tensor):
                continue
            tensor_bytes += t.nbytes
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return {"tensor_bytes": tensor_bytes, "storage_bytes": sum(storages.values())}


@torch.inference_mode()
def memory_child(model_name: str, impl: str, context: int, decode_steps: int, n_layers: int) -> dict:
    """One measurement in this (fresh) process; see the module docstring."""
    torch.manual_seed(0)
    args = bench_args(model_name, max_batch_size=1, n_layers=n_layers)
    ours = impl.startswith("ours")
    model = ours_alone(args) if ours else hf_model(args)
    prompt = random_prompts(1, context, args.vocab_size, seed=11)[0]
    # Warm-up: library buffers and thread pools belong to the baseline, not to the context.
    if ours:
        ours_chunked_prefill(model, prompt[:8], 8)
    else:
        hf_full_prefill(model, prompt[:8])
    gc.collect()
    reset = _reset_peak()
    baseline_kb = _status_kb("VmRSS")
    start = time.perf_counter()
    result: Dict[str, object] = {"model": model_name, "impl": impl, "context": context, "peak_reset": reset}
    if ours:
        chunk = args.sliding_window if impl == "ours-window" else default_chunk_size(1)
        logits, cache = ours_chunked_prefill(model, prompt, chunk)
        result["cache_bytes_after_prefill"] = cache.nbytes()
        tokens = logits.argmax(-1)[None]
        for _ in range(decode_steps):
            tokens = model(tokens, [1], cache).argmax(-1)
        result["cache_bytes"] = cache.nbytes()
        result["cache_storage_bytes"] = cache.nbytes()
    else:
        logits, past = hf_full_prefill(model, prompt)
        after_prefill = hf_cache_bytes(past)
        result["cache_bytes_after_prefill"] = after_prefill["tensor_bytes"]
        result["cache_storage_bytes_after_prefill"] = after_prefill["storage_bytes"]
        tokens = logits.argmax(-1)[None]
        for _ in range(decode_steps):
            out = model(tokens[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens = out.logits[:, -1].argmax(-1)
        after = hf_cache_bytes(past)
        result["cache_bytes"] = after["tensor_bytes"]
        result["cache_storage_bytes"] = after["storage_bytes"]
    result["seconds"] = time.perf_counter() - start
    result["baseline_rss_mb"] = baseline_kb / 1024
    result["peak_rss_delta_mb"] = (_status_kb("VmHWM") - baseline_kb) / 1024
    return result


def run_memory_child(model_name: str, impl: str, context: int, decode_steps: int, n_layers: int, log) -> dict:
    command = [
        sys.executable, os.path.abspath(__file__), "--child-memory", model_name, impl, str(context),
        "--decode-steps", str(decode_steps), "--layers", str(n_layers),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        log(f"  memory {model_name} {impl} {context}: FAILED (rc {proc.returncode}) {proc.stderr[-500:]}")
        return {"model": model_name, "impl": impl, "context": context, "error": proc.stderr[-2000:], "rc": proc.returncode}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    log(
        f"  memory ctx {context:5d} {impl:12s}: cache {result['cache_bytes'] / 2**20:6.1f} MiB "
        f"(after prefill {result['cache_bytes_after_prefill'] / 2**20:.1f}), peak +{result['peak_rss_delta_mb']:.0f} MB, "
        f"{result['seconds']:.1f}s"
    )
    return result


# --------------------------------------------------------------------------- report


def mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def table(results: dict) -> str:
    lines = []
    m = results["machine"]
    lines.append(
        f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
        f"transformers {m['transformers']}, float32"
    )
    lines.append(f"read bandwidth: {results['bandwidth_gb_s']:.1f} GB/s at the start (best of 7 sums over 1.5 GB)")
    load = results.get("other_cpu_load")
    if load is not None:
        if load["busy_samples"]:
            lines.append(
                f"WARNING: other processes used the CPU in {load['busy_samples']} of {load['samples']} samples "
                f"(every 5 s): " + "; ".join(f"{cmd} ({share:.0%})" for cmd, share in load["offenders"].items())
            )
        else:
            lines.append(f"no other process used the CPU during the run ({load['samples']} samples, every 5 s)")
    for name, r in results["models"].items():
        lines.append("")
        lines.append(f"== {name} (weights {r['weights_gb']:.2f} GB, {r['hf_impl']})")
        lines.append(f"{'measurement':34s} {'ours':>10s} {'transformers':>13s} {'ours/hf':>8s}")
        for d in r["decode"]:
            eq = "tokens equal" if d["greedy_tokens_equal"] else f"tokens differ from step {d['first_divergence_step']}"
            lines.append(
                f"{'decode b' + str(d['batch']) + ' tok/s':34s} {d['ours_tok_s']:10.1f} {d['hf_tok_s']:13.1f} "
                f"{d['speedup']:7.2f}x  ({d['ours_ms_per_step']:.1f} vs {d['hf_ms_per_step']:.1f} ms/step; {eq})"
            )
        for p in r.get("prefill") or []:
            lines.append(
                f"{'prefill ' + str(p['tokens']) + ' tok/s, ' + p['logits'] + ' logits':34s} {p['ours_tok_s']:10.0f} "
                f"{p['hf_tok_s']:13.0f} {p['speedup']:7.2f}x  (ours chunk {p['chunk']}"
                f"{' (default)' if p['default_chunk'] else ''}; last-logit diff {p['last_logits_max_abs_diff']:.1e})"
            )
        c = r["ceiling"]
        if c["ours_fraction_b1"] is not None:
            lines.append(
                f"{'bytes read per decode step b1':34s} {c['bytes_b1'] / 1e6:9.1f}M  at {c['bandwidth_gb_s']:.1f} GB/s "
                f"(median of {len(c['ours_fraction_b1_runs']) * 2 + 1} readings around the b1 runs, "
                f"{c['bandwidth_gb_s_range'][0]:.1f}-{c['bandwidth_gb_s_range'][1]:.1f}) -> ceiling {c['tok_s_b1']:.1f} "
                f"tok/s; each run against the higher reading beside it: ours b1 = {c['ours_fraction_b1']:.0%} "
                f"(runs {', '.join(f'{f:.0%}' for f in c['ours_fraction_b1_runs'])}), "
                f"transformers b1 = {c['hf_fraction_b1']:.0%}"
            )
        mem = r.get("memory", [])
        if mem:
            lines.append(
                "memory, batch 1: KV = cache tensors' bytes after prefill + 4 decode steps (@prefill: right after the "
                "prefill; alloc: the storages behind them); peak RSS over the baseline with the weights loaded"
            )
            lines.append(
                f"{'context':>8s} {'impl':>12s} {'KV MiB':>8s} {'KV MiB@prefill':>15s} {'alloc MiB@prefill':>18s} "
                f"{'peak RSS +MB':>13s}"
            )
            for e in mem:
                if "error" in e:
                    lines.append(f"{e['context']:8d} {e['impl']:>12s}  failed (rc {e['rc']})")
                    continue
                lines.append(
                    f"{e['context']:8d} {e['impl']:>12s} {mib(e['cache_bytes']):>8s} {mib(e['cache_bytes_after_prefill']):>15s} "
                    f"{mib(e.get('cache_storage_bytes_after_prefill', e['cache_bytes_after_prefill'])):>18s} "
                    f"{e['peak_rss_delta_mb']:13.0f}"
                )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument(
        "--budget", type=float, default=100.0,
        help="seconds per side for the timed runs of one measurement: fewer runs (at least 1) when they would "
        "take longer (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--prefill-len", type=int, default=PREFILL_LEN)
    parser.add_argument("--contexts", type=int, nargs="*", default=list(CONTEXTS), help="memory runs, x the window")
    parser.add_argument("--decode-steps", type=int, default=4, help="decode steps after each memory prefill")
    parser.add_argument("--layers", type=int, default=8, help="layers (8 by default; fewer for smoke tests)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 layers, 1 repeat, few tokens")
    parser.add_argument("--child-memory", nargs=3, metavar=("MODEL", "IMPL", "CONTEXT"), help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)

    if cli.child_memory:
        model_name, impl, context = cli.child_memory
        print(json.dumps(memory_child(model_name, impl, int(context), cli.decode_steps, cli.layers)))
        return 0

    if cli.quick:
        cli.layers, cli.repeats, cli.new_tokens, cli.prefill_len, cli.contexts = 2, 1, 8, 512, [1, 4]

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    watcher = CpuWatcher().start()
    results: dict = {"machine": machine_info(), "busy_processes": other_busy_processes()}
    if results["busy_processes"]:
        log("WARNING: other processes are using the CPU; the timings will be low:\n  " + "\n  ".join(results["busy_processes"]))
    results["bandwidth_gb_s"] = read_bandwidth() / 1e9
    log(f"read bandwidth {results['bandwidth_gb_s']:.1f} GB/s")
    results["settings"] = {
        "window": WINDOW, "prompt_len": PROMPT_LEN, "new_tokens": cli.new_tokens, "prefill_len": cli.prefill_len,
        "repeats": cli.repeats, "layers": cli.layers, "contexts": [c * WINDOW for c in cli.contexts],
    }  # fmt: skip
    results["models"] = {}
    for name in cli.models:
        log(f"{name}: building")
        args = bench_args(name, max_batch_size=max(cli.batches), n_layers=cli.layers)
        hf = hf_model(args)
        ours = ours_from_hf(hf, args)
        weights = sum(p.nbytes for p in ours.parameters())
        r: dict = {
            "args": args_to_params(args),
            "weights_gb": weights / 1e9,
            "hf_impl": f"attn={hf.config._attn_implementation}"
            + (f", experts={hf.config._experts_implementation}" if args.moe else ""),
        }
        r["bandwidth_gb_s"] = read_bandwidth() / 1e9  # again: this machine's bandwidth drifts by +-20%
        log(f"  read bandwidth {r['bandwidth_gb_s']:.1f} GB/s")
        r["decode"] = [
            bench_decode(ours, hf, args, b, cli.repeats, cli.new_tokens, cli.budget, log) for b in cli.batches
        ]
        r["prefill"] = (
            bench_prefill(ours, hf, args, cli.prefill_len, cli.repeats, cli.budget, log) if cli.prefill_len else None
        )
        b1 = decode_bytes(ours, 1)
        d1 = next((d for d in r["decode"] if d["batch"] == 1), None)
        r["ceiling"] = {
            "bytes_b1": b1["bytes"],
            "bytes_per_layer_b1": b1["per_layer"],
            "bytes_per_step_expected": {str(b): decode_bytes(ours, b)["bytes"] for b in cli.batches},
            **(ceiling_fractions(d1, b1["bytes"]) if d1 else {"ours_fraction_b1": None}),
        }
        del ours, hf
        gc.collect()
        r["memory"] = [
            run_memory_child(name, impl, c * WINDOW, cli.decode_steps, cli.layers, log)
            for c in cli.contexts
            for impl in ("ours", "ours-window", "transformers")
        ]
        results["models"][name] = r
        if cli.out:  # partial results, in case a later model fails
            cli.out.parent.mkdir(parents=True, exist_ok=True)
            cli.out.write_text(json.dumps(results, indent=2) + "\n")
    results["busy_processes_at_end"] = other_busy_processes()
    results["other_cpu_load"] = watcher.stop()
    results["total_seconds"] = time.perf_counter() - t0
    text = table(results)
    print(text)
    print(f"\ntotal {results['total_seconds']:.0f}s")
    if cli.out:
        cli.out.parent.mkdir(parents=True, exist_ok=True)
        cli.out.write_text(json.dumps(results, indent=2) + "\n")
        log(f"wrote {cli.out}")
        from plots import plot_after_run  # bench/plots.py: the plot beside the JSON

        plot_after_run("transformers", cli.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
