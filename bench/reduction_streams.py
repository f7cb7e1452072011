"""In how many places compiled reductions read a weight (``Tuning.streams``), whole models.

    python bench/reduction_streams.py FOLDER [--dtype bfloat16] [--quantize int8] [--streams 1 8]
                                     [--experts] [--batch 1] [--rounds 5]
                                     [--out bench/results_reduction_streams.jsonl]

One copy of the model per value of ``--streams``, loaded with a tuning of that many places (this
machine's otherwise) and its compiled decode step built once, before timing (``generate`` keeps it
with the model), then compiled decode of 128 tokens after a 64-token prompt at ``--batch``, the
copies alternating, ``--rounds`` times. With ``--experts`` the values set ``expert_streams`` instead:
the places of a Mixtral's chosen experts' products only, every other product read in the machine
tuning's number. Prints (and appends to ``--out``) one JSON line: medians and every run, tokens/s.
The fastest is what to pass as ``load_model(..., tuning=Tuning(streams=...))`` on this machine.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_modes import alternating_tok_s, copies_parser, decode_seconds, report_copies  # noqa: E402

from mixtral_infer import load_model  # noqa: E402
from mixtral_infer.formats.measured import machine_tuning  # noqa: E402
from mixtral_infer.hardware import cpu_info  # noqa: E402

NEW_TOKENS = 128


def main(argv=None) -> int:
    parser = copies_parser(__doc__.split("\n")[0])
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--experts", action="store_true", help="set expert_streams, not streams")
    options = parser.parse_args(argv)
    prompts = [list(range(1 + i, 65 + i)) for i in range(options.batch)]
    models = {}
    for streams in options.streams:
        tuning = dataclasses.replace(machine_tuning(), **{"expert_streams" if options.experts else "streams": streams})
        model = load_model(options.folder, max_batch_size=options.batch, device="cpu", tuning=tuning,
                           dtype=getattr(torch, options.dtype), quantize=options.quantize, pack="columns")
        decode_seconds(model, prompts, "compiled", NEW_TOKENS)  # builds the step at the timed shapes
        models[streams] = model
    runs = alternating_tok_s(models, prompts, options.rounds, NEW_TOKENS)
    report_copies(runs, options.out, folder=options.folder, dtype=options.dtype, quantize=options.quantize,
                  batch=options.batch, places_of="chosen experts" if options.experts else "every product",
                  cpu=cpu_info().model)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
