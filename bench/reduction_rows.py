"""How many rows compiled code should multiply as reductions (``fast/cpu_reductions.REDUCTION_ROWS``).

    python bench/reduction_rows.py [--rows 1 2 3 4 8] [--rounds 5]

For each count of rows, compiled (``dynamic=False``), one 3584 x 1024 weight after another (more of
them than the caches hold), alternating, medians of ``--rounds``, ms a weight:

* float32: ``rows_as_reductions`` against ``model.linear.linear`` with reductions off (the bmm blocks
  on AMD CPUs, ``F.linear`` elsewhere);
* bfloat16 activations, plain bfloat16 weight: reductions against ``F.linear``;
* int8 weight (one scale a row): reductions against ``_weight_int8pack_mm``.

Prints one JSON line per count of rows.

    python bench/reduction_rows.py --model FOLDER [--dtype bfloat16] [--quantize int8] [--batches 4 8]

Whole models instead: compiled decode at each batch, one copy of the model whose step was built with
every dtype's reductions limited to 2 rows (as before 2026-11-25) and one with ``REDUCTION_ROWS``
as it is, alternating, medians of ``--rounds``, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_decode_modes import alternating_tok_s  # noqa: E402

import mixtral_infer.fast.cpu_reductions as cpu_reductions  # noqa: E402
from mixtral_infer.formats.linear import linear  # noqa: E402
from mixtral_infer.quant.scheme import QuantScheme  # noqa: E402
from mixtral_infer.quant.weights import quantize  # noqa: E402

OUT, IN = 3584, 1024


def library_float32(x, weight):
    """``linear()`` as it multiplies float32 when no rows are reductions."""
    held = dict(cpu_reductions.REDUCTION_ROWS)
    cpu_reductions.REDUCTION_ROWS[torch.float32] = 0  # read when traced
    try:
        return linear(x, weight)
    finally:
        cpu_reductions.REDUCTION_ROWS.update(held)


def whole_models(options) -> None:
    from mixtral_infer import generate, load_model

    dtype = getattr(torch, options.dtype)
    now = dict(cpu_reductions.REDUCTION_ROWS)
    limits = {"2 rows": {key: 2 for key in now}, "by dtype": now}
    models = {
        name: load_model(options.model, dtype=dtype, device="cpu", max_batch_size=max(options.batches),
                         pack="columns", quantize=options.quantize)
        for name in limits
    }  # fmt: skip
    for batch in options.batches:
        prompts = [[1 + i, 2, 3, 4] for i in range(batch)]
        for name, model in models.items():  # each copy's step is built (traced) under its limits
            cpu_reductions.REDUCTION_ROWS.update(limits[name])
            generate(prompts, model, decode="compiled", max_tokens=4)
        cpu_reductions.REDUCTION_ROWS.update(now)
        runs = {name: [round(v, 1) for v in samples]
                for name, samples in alternating_tok_s(models, prompts, options.rounds, 48).items()}  # fmt: skip
        medians = {name: statistics.median(samples) for name, samples in runs.items()}
        print(json.dumps({"model": options.model, "dtype": options.dtype, "quantize": options.quantize, "batch": batch,
                          "torch": torch.__version__, "tok_s": medians, "runs": runs}), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=None, help="a model folder: whole models (docstring)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8])
    options = parser.parse_args()
    if options.model is not None:
        return whole_models(options)
    torch.manual_seed(0)
    float32 = [(torch.randn(OUT, IN),) for _ in range(16)]  # 235 MB
    bfloat16 = [(torch.randn(OUT, IN, dtype=torch.bfloat16),) for _ in range(32)]
    int8 = [quantize(torch.randn(OUT, IN), QuantScheme("int8"), torch.bfloat16) for _ in range(32)]
    int8 = [(w.values, w.scales) for w in int8]

    def compiled(fn):
        return torch.compile(fn, dynamic=False)

    for rows in options.rows:
        torch._dynamo.reset()
        x32, x16 = torch.randn(rows, IN), torch.randn(rows, IN, dtype=torch.bfloat16)
        ways = {
            "float32 reductions": (compiled(cpu_reductions.rows_as_reductions), x32, float32),
            "float32 library": (compiled(library_float32), x32, float32),
            "bfloat16 reductions": (compiled(cpu_reductions.rows_as_reductions), x16, bfloat16),
            "bfloat16 F.linear": (compiled(F.linear), x16, bfloat16),
            "int8 reductions": (compiled(cpu_reductions.rows_as_reductions), x16, int8),
            "int8 kernel": (compiled(torch.ops.aten._weight_int8pack_mm), x16, int8),
        }
        times = {name: [] for name in ways}
        for _ in range(options.rounds):
            for name, (way, x, weights) in ways.items():
                for weight in weights:
                    way(x, *weight)
                start = time.perf_counter()
                for weight in weights:
                    way(x, *weight)
                times[name].append((time.perf_counter() - start) / len(weights) * 1e3)
        medians = {name: round(statistics.median(samples), 3) for name, samples in times.items()}
        print(json.dumps({"rows": rows, "torch": torch.__version__, "threads": torch.get_num_threads(), "ms": medians}))


if __name__ == "__main__":
    main()
