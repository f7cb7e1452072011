"""Compiled decoding of one model folder quantized each way, the copies alternating in one process.

    python bench/quant_schemes.py FOLDER [--schemes int8 int4 nf4] [--batch 1] [--rounds 5]
                                  [--out bench/results_quant_schemes.jsonl]

The int4 target is relative to our own int8 (4-bit decode >= 1.3x int8), and a shared machine's
memory bandwidth can move by 20-25% from one run to the next: so the schemes are timed here side by
side, one copy of the model per scheme (loaded as ``main.py --decode compiled`` loads, bfloat16
activations), each copy's compiled step built first, then 128 tokens after a 64-token prompt by
each copy in turn, ``--rounds`` times. Prints (and appends to ``--out``) one JSON line: medians
and every run, tokens/s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_modes import alternating_tok_s, copies_parser, decode_seconds, report_copies  # noqa: E402

from mixtral_infer import load_model  # noqa: E402
from mixtral_infer.hardware import cpu_info  # noqa: E402

NEW_TOKENS = 128


def main(argv=None) -> int:
    parser = copies_parser(__doc__.split("\n")[0])
    parser.add_argument("--schemes", nargs="+", default=["int8", "int4", "nf4"])
    options = parser.parse_args(argv)
    prompts = [list(range(1 + i, 65 + i)) for i in range(options.batch)]
    models = {}
    for scheme in options.schemes:
        model = load_model(options.folder, max_batch_size=options.batch, device="cpu",
                           dtype=getattr(torch, options.dtype), quantize=scheme, pack="columns")  # fmt: skip
        decode_seconds(model, prompts, "compiled", NEW_TOKENS)  # builds the step at the timed shapes
        models[scheme] = model
    runs = alternating_tok_s(models, prompts, options.rounds, NEW_TOKENS)
    report_copies(runs, options.out, folder=options.folder, dtype=options.dtype, batch=options.batch,
                  vendor=cpu_info().vendor)  # fmt: skip
    if options.out:
        from plots import plot_after_run  # bench/plots.py: the plot beside the JSON lines

        plot_after_run("quant_schemes", options.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
