"""How many places one compiled loop should read its weights in, when inductor fuses several weights.

    python bench/fused_places.py [--fused 1 2 4] [--places 1 2 4 8] [--rounds 9]

``cpu_reductions.row_sums`` reads a weight in up to ``Tuning.streams`` places at once. Products that
read the same row of activations and loop over as many weight rows are fused by inductor into one
loop: a bfloat16 Mixtral's two chosen experts' ``w1`` and ``w3`` are one loop reading 4 x k places
(hence ``Tuning.expert_streams``, the places for them). Here one bfloat16 row times 96 weights of 3584 x 1024
(Mixtral-bench's experts; 700 MB, more than any cache), ``--fused`` of them per compiled call, each
read in ``--places`` places: every variant compiled in one process, then all of them in turn for
``--rounds`` rounds (this VM's bandwidth moves by 20% within minutes, so compare within a round).
Prints GB/s of weights read, the median and each round's, as one JSON line per variant.
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
from mixtral_infer.fast import cpu_reductions  # noqa: E402
from mixtral_infer.steps.cpu_aot_step import CPU_INDUCTOR_OPTIONS  # noqa: E402

OUT, IN, WEIGHTS = 3584, 1024, 96


def products(x: torch.Tensor, weights: list, places: int) -> torch.Tensor:
    """``x (1, IN)`` times each of ``weights`` as the package multiplies them, each read in ``places``
    places (``Tuning.streams``; ``places`` keys the compiled variant)."""
    return torch.cat([cpu_reductions.rows_as_reductions(x, weight, streams=places) for weight in weights], -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fused", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--places", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=9)
    options = parser.parse_args()

    torch.manual_seed(0)
    torch._dynamo.config.cache_size_limit = 64  # one compiled entry per variant
    weights = [torch.randn(OUT, IN).to(torch.bfloat16) for _ in range(WEIGHTS)]
    x = torch.randn(1, IN).to(torch.bfloat16)
    compiled = torch.compile(products, dynamic=False, options=dict(CPU_INDUCTOR_OPTIONS))
    variants = [(fused, places) for fused in options.fused for places in options.places]
    for fused, places in variants:
        compiled(x, weights[:fused], places)  # OUT = 3584 is read in all of them (``cpu_reductions.places``)

    def gb_s(fused: int, places: int) -> float:
        start = time.perf_counter()
        for i in range(0, WEIGHTS, fused):
            compiled(x, weights[i : i + fused], places)
        return WEIGHTS * OUT * IN * 2 / (time.perf_counter() - start) / 1e9

    runs = {variant: [] for variant in variants}
    for _ in range(options.rounds):
        for variant in variants:
            runs[variant].append(round(gb_s(*variant), 1))
    for (fused, places), gbs in runs.items():
        print(json.dumps({"fused": fused, "places": places, "gb_s": statistics.median(gbs), "rounds": gbs}))


if __name__ == "__main__":
    main()
