"""Weight-only quantization on CPU: which kernel, how close to bfloat16, how fast.

1. Kernels: 1-8 rows of bfloat16 times a mixtral-bench expert weight (3584 x 1024 and
   1024 x 3584): bfloat16 ``linear()``, PyTorch's ``_weight_int8pack_mm`` and
   ``_weight_int4pack_mm_for_cpu``, fbgemm's int8 product with int8 activations (w8a8),
   torchao 0.18's ``Int8WeightOnlyConfig`` / ``Int4WeightOnlyConfig`` on an ``nn.Linear``, and
   the dequantize-then-matmul reference.
2. Quality on the bench shapes (random weights, seed 0, as ``bench_vs_transformers.py``):
   logits' max abs difference against bfloat16 and greedy-token agreement, teacher-forced on
   the bfloat16 model's 64 greedy tokens after a 64-token prompt.
3. Decode speed at batch 1: float32, bfloat16, int8, w8a8, int4 (eager loop, 64 tokens, best of 3).

    .venv/bin/python bench/bench_quant.py --out bench/results_quant.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import bench_vs_transformers as b  # noqa: E402

from mixtral_infer.formats.linear import linear  # noqa: E402
from mixtral_infer.quant import int8_activations  # noqa: E402
from mixtral_infer.quant.kernels import prepare, reference_linear  # noqa: E402
from mixtral_infer.formats.quantizing import quantize_model  # noqa: E402
from mixtral_infer.quant.weights import QuantScheme, quantize  # noqa: E402


def best_ms(fn, repeats: int = 30) -> float:
    """The fastest of ``repeats`` calls: the machine is shared, the minimum is the least disturbed."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def torchao_linear(weight: torch.Tensor, scheme: str):
    """torchao's weight-only quantization of an nn.Linear, or the reason it does not run here."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
        module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
        module.weight.data.copy_(weight)
        quantize_(module, Int8WeightOnlyConfig() if scheme == "int8" else Int4WeightOnlyConfig(group_size=32))
        module(torch.zeros(1, weight.shape[1], dtype=torch.bfloat16))
        return module
    except Exception as error:  # noqa: BLE001 - the reason is the result
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"


@torch.inference_mode()
def kernels() -> list:
    rows_out = []
    for shape in ((3584, 1024), (1024, 3584)):
        weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        int8 = prepare(quantize(weight, QuantScheme.parse("int8"), torch.bfloat16))
        int4 = prepare(quantize(weight, QuantScheme.parse("int4"), torch.bfloat16))
        int4_plain = quantize(weight, QuantScheme.parse("int4"), torch.bfloat16)
        w8a8 = quantize(weight, QuantScheme.parse("w8a8"), torch.bfloat16)
        int8_activations.pack_weights([w8a8])
        ao = {scheme: torchao_linear(weight, scheme) for scheme in ("int8", "int4")}
        for rows in (1, 2, 4, 8):
            x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
            row = {"shape": list(shape), "rows": rows,
                   "bfloat16 linear()": best_ms(lambda: linear(x, weight)),
                   "bfloat16 F.linear": best_ms(lambda: F.linear(x, weight)),
                   "int8 aten._weight_int8pack_mm": best_ms(lambda: linear(x, int8)),
                   "int4 aten._weight_int4pack_mm_for_cpu": best_ms(lambda: linear(x, int4)),
                   "w8a8 fbgemm (int8 activations)": best_ms(lambda: linear(x, w8a8)),
                   "int8 dequantize + F.linear": best_ms(lambda: reference_linear(x, int8), 5),
                   "int4 dequantize + F.linear": best_ms(lambda: reference_linear(x, int4_plain), 5)}  # fmt: skip
            for scheme, module in ao.items():
                row[f"{scheme} torchao"] = best_ms(lambda: module(x)) if not isinstance(module, str) else module
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    return rows_out


SCHEMES = ("int8", "w8a8", "int4", "nf4")


@torch.inference_mode()
def quality_and_speed(name: str, n_layers: int) -> dict:
    args = b.bench_args(name, max_batch_size=1, n_layers=n_layers)
    models = {"bfloat16": b.ours_alone(args, seed=0).to(torch.bfloat16)}
    for scheme in SCHEMES:
        models[scheme] = quantize_model(copy.deepcopy(models["bfloat16"]), scheme)
    prompt = b.random_prompts(1, b.PROMPT_LEN, args.vocab_size, seed=1001)
    _, greedy = b.ours_decode(models["bfloat16"], prompt, 64)
    ids = torch.tensor(prompt[0] + greedy[0][:-1])
    reference = models["bfloat16"](ids, seqlens=[len(ids)]).float()  # (T, V)
    result = {"model": name, "n_layers": n_layers, "positions": len(ids)}
    for scheme in SCHEMES:
        logits = models[scheme](ids, seqlens=[len(ids)]).float()
        new = slice(b.PROMPT_LEN - 1, None)  # the positions that predicted the greedy tokens
        result[scheme] = {
            "logits_max_abs_diff": (logits - reference).abs().max().item(),
            "reference_logits_max_abs": reference.abs().max().item(),
            "greedy_agreement": (logits[new].argmax(-1) == reference[new].argmax(-1)).float().mean().item(),
        }
    speed = {}
    for label, model in models.items():
        seconds = min(b.ours_decode(model, prompt, 64)[0] for _ in range(3))
        speed[label] = 64 / seconds
    del models
    speed["float32"] = 64 / min(b.ours_decode(b.ours_alone(args, seed=0), prompt, 64)[0] for _ in range(3))
    result["decode_tok_s_batch1"] = speed
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(b.MODELS), choices=b.MODELS)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--out", type=Path)
    cli = parser.parse_args()
    results = {"machine": b.machine_info(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if not cli.skip_kernels:
        results["kernels_ms"] = kernels()
    results["bench_shapes"] = [quality_and_speed(name, cli.layers) for name in cli.models]
    if cli.out:
        cli.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
