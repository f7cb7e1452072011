"""How much of an eager batch-1 decode step is the matmuls, and how much is everything else.

    python bench/decode_overhead.py MODEL_FOLDER [--dtype bfloat16] [--quantize int8|int4] [--steps 40]

Decodes ``--steps`` tokens after a 64-token prompt with ``Transformer.forward`` (the eager path,
as ``ours_run.py``'s loop). After each timed step, an untimed one records every ``linear(x, weight)``
it makes (its inputs, its weights, the experts its router chose), and those calls are replayed
alone, timed. A step minus the replay is what a step costs apart from reading weights: Python,
metadata, norms, rotary embeddings, attention, cache writes, dispatch. Prints one JSON line of
medians in ms.

Measured this way on the 2-core Xeon (``bench/PERFORMANCE_LOG.md``, "Decoding compiled, and what a
step costs apart from its matmuls"): the rest is 3.3-4.9 ms of a mistral-bench step in every dtype
(bfloat16: 4.6 of 19.6 ms, while its matmuls alone take 15.0 and llama.cpp's whole bfloat16 step 15.9).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_transformers as b  # noqa: E402

import mixtral_infer.model.moe as moe_module  # noqa: E402
import mixtral_infer.model.transformer as transformer_module  # noqa: E402
from mixtral_infer import load_model  # noqa: E402
from mixtral_infer.formats.linear import linear  # noqa: E402

CALLERS = (transformer_module, moe_module)  # the modules whose linear() calls a step makes


def recording_linear(calls: list):
    def record(x, weight):
        calls.append((x.clone(), weight))
        return linear(x, weight)

    return record


@torch.inference_mode()
def measure(model, steps: int) -> dict:
    prompts = b.random_prompts(1, b.PROMPT_LEN, model.args.vocab_size, seed=1001)
    cache = model.make_cache(1, max_seqlen=b.PROMPT_LEN + steps + 8)
    cache.start_sequences(1)
    tokens = b.ours_prefill(model, cache, prompts, b.PROMPT_LEN).argmax(-1)
    for _ in range(4):  # warm-up
        tokens = model(tokens, [1], cache).argmax(-1)
    step_ms, matmul_ms, n_calls = [], [], 0
    for _ in range(steps):
        calls: list = []
        start = time.perf_counter()
        tokens = model(tokens, [1], cache).argmax(-1)
        step_ms.append((time.perf_counter() - start) * 1e3)
        for caller in CALLERS:  # the next step, untimed, records its calls
            caller.linear = recording_linear(calls)
        try:
            tokens = model(tokens, [1], cache).argmax(-1)
        finally:
            for caller in CALLERS:
                caller.linear = linear
        start = time.perf_counter()
        for x, weight in calls:
            linear(x, weight)
        matmul_ms.append((time.perf_counter() - start) * 1e3)
        n_calls = len(calls)
    step, matmuls = statistics.median(step_ms), statistics.median(matmul_ms)
    rest = statistics.median(s - m for s, m in zip(step_ms, matmul_ms))
    return {"step_ms": round(step, 2), "matmuls_alone_ms": round(matmuls, 2), "rest_ms": round(rest, 2),
            "rest_share": round(rest / step, 3), "linear_calls": n_calls}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--steps", type=int, default=40)
    cli = parser.parse_args()
    model = load_model(cli.folder, max_batch_size=1, device="cpu", dtype=getattr(torch, cli.dtype), quantize=cli.quantize)
    out = {"folder": cli.folder, "dtype": cli.dtype, "quantize": cli.quantize, **measure(model, cli.steps)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
