"""Integer dot products (issue 75, ``kernels/linear/int_dots.py``) beside the weight-only products, one
weight at a time, at Mistral 7B's widths.

Per scheme (int8; int4 in groups of 32) and number of activation rows (``--rows``), bfloat16 activations
times the 7 matrices of one Mistral 7B layer (``wq wk wv wo w1 w2 w3``: 4096 x 4096, 1024 x 4096 twice,
4096 x 4096, 14336 x 4096 twice, 4096 x 14336; 218 M weights, beyond any cache) in turn, each way:

* ``dots``: the operators of ``kernels/int_dots.cpp`` (``IntDotsLinear.product``'s; up to 8 rows in one
  pass over the weight, more in panels of the weight held in L2);
* ``kernel``: the eager weight-only back-end, as the machine's tuning runs it (``Int8Linear``:
  ``_weight_int8pack_mm``, from 512 rows dequantized and ``F.linear``; ``Int4Linear``:
  ``_weight_int4pack_mm_for_cpu`` on its layout, from 512 or 1024 rows read back and ``F.linear``).

Ways alternate within each round (``--rounds``), the report is the median milliseconds per layer, GB/s of
weight bytes (integers and scales) and the ratio of each way to ``dots``.

    .venv/bin/python bench/bench_int_dots.py --out bench/results_int_dots.json
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
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_speculative import machine  # noqa: E402

from mixtral_infer.formats.measured import machine_tuning  # noqa: E402
from mixtral_infer.kernels.linear import Int4Linear, Int8Linear, IntDotsLinear  # noqa: E402
from mixtral_infer.kernels.linear.int_dots import available  # noqa: E402
from mixtral_infer.quant.scheme import QuantScheme  # noqa: E402
from mixtral_infer.quant.weights import quantize  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]


def weights(scheme: QuantScheme, backend=None):
    """One layer's matrices, random (N(0, 0.02)), quantized, laid out for ``backend`` (int4: the integer
    dot products' rows with their scales inline, or the CPU int4 kernel's layout)."""
    torch.manual_seed(0)
    out = []
    for shape in SHAPES:
        weight = quantize(torch.randn(shape) * 0.02, scheme, torch.bfloat16)
        if backend is not None:
            backend.prepare(weight, machine_tuning(), keep_values=True)
        out.append(weight)
    return out


def weight_bytes(ws) -> int:
    return sum(w.values.numel() * w.values.element_size() + w.scales.numel() * 2 for w in ws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 512, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--schemes", nargs="+", default=["int8", "int4"])
    parser.add_argument("--out", type=Path)
    options = parser.parse_args()
    if not available():
        sys.exit("the integer kernels are not available here")
    tuning = machine_tuning()
    ops = torch.ops.mixtral_infer_dots
    results = {"machine": machine(), "options": {k: str(v) for k, v in vars(options).items()}, "schemes": {}}
    for name in options.schemes:
        scheme = QuantScheme("int8") if name == "int8" else QuantScheme("int4", 32)
        plain = weights(scheme, IntDotsLinear)
        laid_out = plain if name == "int8" else weights(scheme, Int4Linear)
        size = weight_bytes(plain)
        table = {}
        for rows in options.rows:
            xs = {w.in_features: torch.randn(rows, w.in_features, dtype=torch.bfloat16) for w in plain}

            def dots():
                if name == "int8":
                    return [ops.int8_dots(xs[w.in_features], w.values, w.scales) for w in plain]
                return [ops.int4_dots(xs[w.in_features], w.packed[0], w.in_features, 32) for w in plain]

            backend = Int8Linear if name == "int8" else Int4Linear
            ways = {"dots": dots, "kernel": lambda: [backend.product(xs[w.in_features], w, tuning) for w in laid_out]}
            for way in ways.values():
                way()  # warm-up
            times = {way: [] for way in ways}
            for _ in range(options.rounds):
                for way, fn in ways.items():
                    start = time.perf_counter()
                    fn()
                    times[way].append(time.perf_counter() - start)
            ms = {way: statistics.median(t) * 1e3 for way, t in times.items()}
            table[rows] = {way: {"ms": round(v, 2), "GB/s": round(size / v / 1e6, 1), "of_dots": round(v / ms["dots"], 2)}
                           for way, v in ms.items()}  # fmt: skip
            print(name, f"rows={rows:4d}", "  ".join(f"{way} {v:8.2f} ms ({v / ms['dots']:.2f}x)" for way, v in ms.items()), flush=True)
        results["schemes"][name] = {"bytes_per_layer": size, "rows": table}
    if options.out:
        options.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
