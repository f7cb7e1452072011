"""In how many places compiled reductions read a weight (``fast/cpu_reductions.STREAMS``), whole models.

    python bench/reduction_streams.py FOLDER [--dtype bfloat16] [--quantize int8] [--streams 1 8]
                                     [--experts] [--batch 1] [--rounds 5]
                                     [--out bench/results_reduction_streams.jsonl]

One copy of the model per value of ``--streams``, each with its compiled decode step built while
``STREAMS`` had that value (built once, before timing: ``generate`` keeps it with the model), then
compiled decode of 128 tokens after a 64-token prompt at ``--batch``, the copies alternating,
``--rounds`` times. With ``--experts`` the values set ``EXPERT_STREAMS`` instead: the places of a
Mixtral's chosen experts' products only (``cpu_reductions.chosen_experts``), every other product
read in the CPU vendor's number. Prints (and appends to ``--out``) one JSON line: medians and every
run, tokens/s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_modes import alternating_tok_s, copies_parser, decode_seconds, report_copies  # noqa: E402

from mixtral_infer import load_model  # noqa: E402
from mixtral_infer.fast import cpu_reductions  # noqa: E402
from mixtral_infer.hardware import cpu_info  # noqa: E402

NEW_TOKENS = 128


def main(argv=None) -> int:
    parser = copies_parser(__doc__.split("\n")[0])
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--experts", action="store_true", help="set EXPERT_STREAMS, not STREAMS")
    options = parser.parse_args(argv)
    prompts = [list(range(1 + i, 65 + i)) for i in range(options.batch)]
    models = {}
    for streams in options.streams:
        setattr(cpu_reductions, "EXPERT_STREAMS" if options.experts else "STREAMS", streams)
        model = load_model(options.folder, max_batch_size=options.batch, device="cpu",
                           dtype=getattr(torch, options.dtype), quantize=options.quantize, pack="columns")
        decode_seconds(model, prompts, "compiled", NEW_TOKENS)  # builds the step at the timed shapes
        models[streams] = model
    runs = alternating_tok_s(models, prompts, options.rounds, NEW_TOKENS)
    report_copies(runs, options.out, folder=options.folder, dtype=options.dtype, quantize=options.quantize,
                  batch=options.batch, places_of="chosen experts" if options.experts else "every product",
                  vendor=cpu_info().vendor)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
