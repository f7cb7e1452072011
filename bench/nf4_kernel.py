"""How fast bitsandbytes' NF4 kernel multiplies one row, beside our int4 and int8 products.

    python bench/nf4_kernel.py [--shape 3584 1024] [--weights 96] [--rounds 9]
                               [--out bench/results_nf4_kernel.jsonl]

One bfloat16 row times ``--weights`` weights of one shape (more than the caches hold), each way
one call over all of them, the ways alternating, medians of ``--rounds``:

* ``nf4``: ``mixtral_infer::nf4_mm`` (bitsandbytes' ``gemv_4bit_inference_cpu_nf4_bf16`` on its
  layout, ``quant/nf4.py``), groups of 64, op by op;
* ``int4``: PyTorch's ``_weight_int4pack_mm_for_cpu`` (what int4 runs), groups of 32, op by op;
* ``int8``: our int8 reductions (``fast.cpu_reductions.rows_as_reductions``), compiled, one graph.

Prints (and appends to ``--out``) one JSON line: ms a weight and billions of weights a second.
Every way's product is first checked against its dequantized weight.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mixtral_infer.fast.cpu_reductions import rows_as_reductions  # noqa: E402
from mixtral_infer.hardware import cpu_info  # noqa: E402
from mixtral_infer.quant import kernels, nf4  # noqa: E402
from mixtral_infer.quant.scheme import QuantScheme  # noqa: E402
from mixtral_infer.quant.weights import quantize  # noqa: E402


@torch.no_grad()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[3584, 1024], metavar=("OUT", "IN"))
    parser.add_argument("--weights", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)
    if nf4.kernel() is None:
        print("no NF4 kernel here: bitsandbytes is not installed or this CPU lacks AVX512-BF16", file=sys.stderr)
        return 1
    out_features, in_features = options.shape
    torch.manual_seed(0)
    x = torch.randn(1, in_features, dtype=torch.bfloat16)

    def weights(scheme: str):
        made = [quantize(torch.randn(out_features, in_features), QuantScheme.parse(scheme), torch.bfloat16)
                for _ in range(options.weights)]  # fmt: skip
        expected = x.float() @ made[0].dequantize().T  # (1, OUT)
        return [kernels.prepare(w) for w in made], expected

    def one_by_one(weights):
        return lambda x: [kernels.quantized_linear(x, w) for w in weights]

    nf4_weights, nf4_expected = weights("nf4")
    int4_weights, int4_expected = weights("int4")
    int8_weights, int8_expected = weights("int8")
    int8_args = [(w.values, w.scales) for w in int8_weights]
    all_int8 = torch.compile(lambda x: [rows_as_reductions(x, *a) for a in int8_args], dynamic=False)
    ways = {"nf4": (one_by_one(nf4_weights), nf4_expected), "int4": (one_by_one(int4_weights), int4_expected),
            "int8": (all_int8, int8_expected)}  # fmt: skip
    for name, (way, expected) in ways.items():
        got = way(x)[0].float()
        torch.testing.assert_close(got, expected, atol=1e-2 * expected.abs().max().item(), rtol=0)

    times = {name: [] for name in ways}
    for _ in range(options.rounds):
        for name, (way, _) in ways.items():
            way(x)  # warm: the loop, not the weights (more than the caches)
            start = time.perf_counter()
            for _ in range(5):
                way(x)
            times[name].append((time.perf_counter() - start) / (5 * options.weights) * 1e3)
    count = out_features * in_features
    row = {"shape": options.shape, "weights": options.weights, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "vendor": cpu_info().vendor}  # fmt: skip
    for name, samples in times.items():
        ms = statistics.median(samples)
        row[name] = {"ms": round(ms, 4), "Gweights/s": round(count / ms / 1e6, 1)}
    print(json.dumps(row))
    if options.out:
        with options.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
