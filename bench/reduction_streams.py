"""In how many places compiled reductions read a weight (``fast/cpu_reductions.STREAMS``), whole models.

    python bench/reduction_streams.py FOLDER [--dtype bfloat16] [--quantize int8] [--streams 1 8]
                                     [--batch 1] [--rounds 5] [--out bench/results_reduction_streams.jsonl]

One copy of the model per value of ``--streams``, each with its compiled decode step built while
``STREAMS`` had that value (built once, before timing: ``generate`` keeps it with the model), then
compiled decode of 128 tokens after a 64-token prompt at ``--batch``, the copies alternating,
``--rounds`` times. Prints (and appends to ``--out``) one JSON line: medians and every run, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_modes import alternating_tok_s, decode_seconds  # noqa: E402

from mixtral_infer import load_model  # noqa: E402
from mixtral_infer.fast import cpu_reductions  # noqa: E402

NEW_TOKENS = 128


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)
    prompts = [list(range(1 + i, 65 + i)) for i in range(options.batch)]
    models = {}
    for streams in options.streams:
        cpu_reductions.STREAMS = streams
        model = load_model(options.folder, max_batch_size=options.batch, device="cpu",
                           dtype=getattr(torch, options.dtype), quantize=options.quantize, pack="columns")
        decode_seconds(model, prompts, "compiled", NEW_TOKENS)  # builds the step at the timed shapes
        models[streams] = model
    runs = alternating_tok_s(models, prompts, options.rounds, NEW_TOKENS)
    row = {"folder": options.folder, "dtype": options.dtype, "quantize": options.quantize, "batch": options.batch,
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "tok_s": {streams: round(statistics.median(r), 1) for streams, r in runs.items()},
           "runs": {streams: [round(v, 1) for v in r] for streams, r in runs.items()}}
    print(json.dumps(row))
    if options.out:
        with options.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
