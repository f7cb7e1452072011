"""What compiling each block as one region buys: the decode step's compile time, and its speed.

    python bench/regional_compile.py [--layers 8 32] [--dtype bfloat16] [--quantize int8] [--batch 1]
                                     [--widths bench|7b] [--device cpu|cuda] [--rounds 3]
                                     [--out bench/results_regional_compile.jsonl]

``steps/decode_step.in_regions``: under ``torch.compile`` each transformer block is a
``torch.compiler.nested_compile_region``, traced and compiled for the first layer and called for
the others. For each ``--layers``, two copies of a random model of mistral-bench's widths (dim
1024, 16 heads over 4, hidden 3584, vocabulary 32000, window 256) with that many layers, the
first's step compiled with every block written out (``Tuning(regions=False)``), the second's with
regions; both by ``torch.compile`` (the path of CUDA and of CPU steps AOTInductor does not build:
``Tuning.ahead_of_time`` off here), in a fresh inductor cache. Then compiled decode of 128 tokens
after a 64-token prompt at ``--batch``, the copies alternating, ``--rounds`` times. Prints (and
appends to ``--out``) one JSON line per layer count: each copy's compile seconds, medians and every
run in tokens/s. The written-out copy compiles first, so a kernel both share (few do: a region's
kernels end at its block) would be cached for the second; built each way in its own process with
its own fresh cache, a scratch script measured the same (dim 256: 8 layers 35.0 -> 16.1 s, 32
layers 121.0 -> 18.0 s; ``bench/PERFORMANCE_LOG.md``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="regional_compile_")  # before torch: nothing kept

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_modes import alternating_tok_s, decode_seconds, report_copies  # noqa: E402

from mixtral_infer import ModelArgs, MoeArgs, Transformer  # noqa: E402
from mixtral_infer.formats.quantizing import quantize_model  # noqa: E402
from mixtral_infer.steps.decode_loop import step_compiler  # noqa: E402
from mixtral_infer.tuning import Tuning  # noqa: E402

NEW_TOKENS = 128


WIDTHS = {
    "bench": dict(dim=1024, head_dim=64, hidden_dim=3584, n_heads=16, n_kv_heads=4, sliding_window=256),
    "7b": dict(dim=4096, head_dim=128, hidden_dim=14336, n_heads=32, n_kv_heads=8, sliding_window=4096),
    "mixtral-bench": dict(dim=1024, head_dim=64, hidden_dim=3584, n_heads=16, n_kv_heads=4, sliding_window=256,
                          moe=MoeArgs(num_experts=8, num_experts_per_tok=2)),
}


def bench_model(widths: str, layers: int, dtype: torch.dtype, batch: int, quantize: str | None, device: str):
    """A model of ``WIDTHS[widths]`` with ``layers`` layers, random weights (seed 0), on ``device``."""
    args = ModelArgs(n_layers=layers, norm_eps=1e-5, vocab_size=32000, max_batch_size=batch, **WIDTHS[widths])
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(args).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0) if name.endswith("norm.weight") else param.normal_(0.0, 0.02)
    model = model.eval()
    return quantize_model(model, quantize) if quantize else model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantize", default=None, choices=["int8", "int4"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--widths", default="bench", choices=sorted(WIDTHS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)
    prompts = [list(range(1 + i, 65 + i)) for i in range(options.batch)]
    for layers in options.layers:
        models, compile_s = {}, {}
        for way, regions in (("blocks written out", False), ("one region a block", True)):
            model = bench_model(options.widths, layers, getattr(torch, options.dtype), options.batch,
                                options.quantize, options.device)  # fmt: skip
            # torch.compile, where regions apply; read when the step is traced, on its first call below
            step_compiler(model).tuning = Tuning(regions=regions, ahead_of_time=False)
            start = time.perf_counter()
            decode_seconds(model, prompts, "compiled", NEW_TOKENS)  # builds the step at the timed shapes
            compile_s[way] = round(time.perf_counter() - start, 1)
            models[way] = model
        runs = alternating_tok_s(models, prompts, options.rounds, NEW_TOKENS)
        report_copies(runs, options.out, widths=options.widths, layers=layers, dtype=options.dtype,
                      quantize=options.quantize, batch=options.batch, device=options.device,
                      compile_s=compile_s)  # fmt: skip
        del models
    return 0


if __name__ == "__main__":
    sys.exit(main())
