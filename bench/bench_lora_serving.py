"""LoRA adapters kept apart and served at once (issue 76, ``formats/adapters.py``) beside the base model alone.

The serving ``Engine`` over ``mistral-wide`` (Mistral 7B's widths, ``--layers`` of its layers, random
weights, bfloat16 packed as ``load_model`` packs it; tiny-mistral's 2000-token vocabulary, so the un-adapted
output layer weighs less than in the real model: the ratios lean against the adapters) with 0 (the base alone), 1, 4 and 16 random adapters of
rank ``--rank`` on all seven projections of every layer (``attach_adapters``; one model each, the same base
weights). 16 requests at once on 16 rows, each a random ``--prompt``-token prompt and ``--tokens`` new tokens
(EOS ignored), request i naming adapter ``1 + i % n`` (every row of a batch reads another adapter at 16);
driven synchronously (submit all, then ``while engine.step()``). Tokens/s from the first submit to the last
token, per decode mode (``eager``: ``Transformer.forward``; ``auto``, the CPU default: the compiled decode step
or the eager pass per step). The engines of a round run in turn, the order reversed every round (AB BA ...);
the report is the median per-round ratio to the base. Each engine serves the workload once untimed first
(steps built). Memory: the bytes the adapters hold (``adapter_bytes``), per adapter, and scaled to 32 layers.

    .venv/bin/python bench/bench_lora_serving.py --out bench/results_lora_serving.json

``--quick``: 1 layer, 8 new tokens, 1 round, eager only (a smoke test; its numbers mean little).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_speculative import machine  # noqa: E402
from bench_vs_transformers import _init_, bench_args  # noqa: E402

from mixtral_infer import Tokenizer, Transformer  # noqa: E402
from mixtral_infer.formats.measured import machine_tuning  # noqa: E402
from mixtral_infer.formats.modules import prepare_and_swap  # noqa: E402
from mixtral_infer.formats.adapters import adapter_bytes, attach_adapters  # noqa: E402
from mixtral_infer.serve.engine import Engine, RequestSettings, TokenEvent  # noqa: E402

PROJECTIONS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def base_model(layers: int) -> Transformer:
    """``mistral-wide`` with ``layers`` layers and tiny-mistral's 2000-token vocabulary (the engine decodes
    every token to text), random weights made in bfloat16, packed as ``load_model`` packs them."""
    args = bench_args("mistral-wide", max_batch_size=1, n_layers=layers)
    args = dataclasses.replace(args, vocab_size=2000)
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _init_(name, param)
    return prepare_and_swap(model, machine_tuning(), pack=True).eval()


def with_adapters(base, n: int, rank: int):
    """A copy of ``base`` with ``n`` random adapters kept apart (each factor N(0, 1/fan_in), scale 1)."""
    model = copy.deepcopy(base)
    generator = torch.Generator().manual_seed(n)
    adapters = []
    for _ in range(n):
        factors = {}
        for layer in model.layers:
            for projection in PROJECTIONS:
                module = model.get_submodule(f"layers.{layer}.{projection}")
                out, inner = module.out_features, module.in_features
                a = torch.randn(rank, inner, generator=generator) / inner**0.5
                b = torch.randn(out, rank, generator=generator) / rank**0.5 * 0.1
                factors[f"layers.{layer}.{projection}.weight"] = (b, a, 1.0)
        adapters.append(factors)
    attach_adapters(model, [f"adapter-{i}" for i in range(n)], adapters)
    return model


def serve_once(engine: Engine, prompts: List[List[int]], adapters: int, max_tokens: int) -> float:
    """Tokens/s serving every prompt at once, request i with adapter 1 + i % adapters (none without)."""
    count = [0]

    def sink(event):
        if isinstance(event, TokenEvent):
            count[0] += 1

    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        adapter = 1 + i % adapters if adapters else 0
        engine.submit(prompt, RequestSettings(max_tokens=max_tokens, ignore_eos=True, adapter=adapter), sink)
    while engine.step():
        pass
    assert count[0] == len(prompts) * max_tokens
    return count[0] / (time.perf_counter() - started)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=["eager", "auto"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    options = parser.parse_args(argv)
    if options.quick:
        options.layers, options.tokens, options.rounds, options.modes = 1, 8, 1, ["eager"]
    torch.set_num_threads(options.threads)
    base = base_model(options.layers)
    tokenizer = Tokenizer.from_folder("tiny-mistral")  # the engine decodes every token to text: the vocabulary's tokenizer
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (options.prompt,), generator=generator).tolist() for _ in range(options.requests)]
    models = {n: base if n == 0 else with_adapters(base, n, options.rank) for n in options.adapters}
    memory = {n: adapter_bytes(models[n]) for n in options.adapters if n}
    results: Dict[str, object] = {"machine": machine(), "options": {k: str(v) for k, v in vars(options).items()}, "modes": {}}
    for mode in options.modes:
        engines = {n: Engine(models[n], tokenizer, options.requests, decode=mode, prefix_reuse=False) for n in options.adapters}
        for n, engine in engines.items():  # untimed: steps built
            engine.warm_up()
            serve_once(engine, prompts, n, options.tokens)
        rates: Dict[int, List[float]] = {n: [] for n in options.adapters}
        for round_ in range(options.rounds):
            order = list(options.adapters) if round_ % 2 == 0 else list(reversed(options.adapters))
            for n in order:
                rates[n].append(serve_once(engines[n], prompts, n, options.tokens))
        ratios = {n: statistics.median(r / b for r, b in zip(rates[n], rates[0])) for n in options.adapters} if 0 in rates else {}
        results["modes"][mode] = {"tok_s": {str(n): rates[n] for n in options.adapters}, "ratio_to_base": {str(n): ratios.get(n) for n in options.adapters}}
        for n in options.adapters:
            print(f"{mode:6s} adapters={n:2d}: {statistics.median(rates[n]):7.1f} tok/s, x{ratios.get(n, float('nan')):.3f} of the base", flush=True)
    per_layer = {str(n): memory[n] / n / options.layers for n in memory}
    results["adapter_bytes"] = {str(n): memory[n] for n in memory}
    results["bytes_per_adapter_per_layer"] = per_layer
    for n, value in per_layer.items():
        print(f"{n} adapters: {value / 2**20:.2f} MiB per adapter per layer, {value * 32 / 2**20:.0f} MiB per adapter at 32 layers (rank {options.rank})")
    if options.out is not None:
        options.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
