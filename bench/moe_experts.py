"""Experts in compiled CPU decoding: plain ones gathered or one by one; every expert or the chosen at B * k >= E.

    python bench/moe_experts.py FOLDER [--dtype bfloat16] [--batch 1] [--rounds 5]
                                [--quantize int8|int4] [--out bench/results_moe_experts.jsonl]

``steps/decode_step.moe_one_token`` multiplies the chosen experts of a step with fewer assignments
than experts one by one on CPU (experts of ``Tuning.one_by_one_min_weights`` or more), each product a
reduction read in 8 places, where the batched product of the gathered experts is one loop read in
one place per core. At a batch with at least as many assignments as experts (``--batch 4`` or more
for top-2 of 8), the copies are every expert on every row, or the chosen ones one by one (the
experts' field of the ``Tuning``, ``decode_step.chosen_up_to_field``: ``chosen_up_to_plain``,
``chosen_up_to_bfloat16``, or with ``--quantize`` ``chosen_up_to_quantized``, at any batch). One copy
of the model each way, its compiled decode step built with the field at that value (``compile_s``), then compiled decode of 128 tokens after a 64-token prompt at
``--batch``, the copies alternating, ``--rounds`` times. Prints (and appends to ``--out``) one JSON
line: medians and every run, tokens/s, and the first 32 greedy tokens of each copy beside the eager
loop's.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_modes import alternating_tok_s, copies_parser, decode_seconds, report_copies  # noqa: E402

from mixtral_infer import generate, load_model  # noqa: E402
from mixtral_infer.checkpoint.loading import open_checkpoint  # noqa: E402
from mixtral_infer.formats.modules import tuning_of  # noqa: E402
from mixtral_infer.steps import decode_step  # noqa: E402
from mixtral_infer.steps.decode_loop import step_compiler  # noqa: E402

NEW_TOKENS = 128
EAGER_TOKENS = 32  # greedy tokens compared with the eager loop's


def greedy(model, prompts, decode: str) -> list:
    """The first prompt's ``EAGER_TOKENS`` greedy new tokens."""
    return generate(prompts, model, max_tokens=EAGER_TOKENS, decode=decode, prompt_logprobs=False)[0][0]


def tokens_in_common(tokens: list, reference: list) -> int:
    """How many of ``tokens`` equal ``reference``'s, up to the first that does not."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def main(argv=None) -> int:
    parser = copies_parser(__doc__.split("\n")[0])
    parser.add_argument("--quantize", default=None, choices=["int8", "int4"])
    options = parser.parse_args(argv)
    prompts = [list(range(1 + i, 65 + i)) for i in range(options.batch)]
    models, compile_s, tokens = {}, {}, {}
    moe = open_checkpoint(options.folder).args.moe
    every_or_chosen = options.quantize or options.batch * moe.num_experts_per_tok >= moe.num_experts
    ways = (("every expert", 0), ("chosen", sys.maxsize))
    if not every_or_chosen:
        ways = (("gathered", sys.maxsize), ("one by one", 0))
    for way, value in ways:
        model = load_model(options.folder, max_batch_size=options.batch, device="cpu",
                           dtype=getattr(torch, options.dtype), pack="columns", quantize=options.quantize)  # fmt: skip
        tuning = tuning_of(model)
        if every_or_chosen:  # the experts' own field (decode_step.chosen_up_to_field), read when the step is built
            field = decode_step.chosen_up_to_field(model.layers["0"].feed_forward, tuning)
            tuning = dataclasses.replace(tuning, **{field: value})
        else:
            tuning = dataclasses.replace(tuning, one_by_one_min_weights=value)
        step_compiler(model).tuning = tuning
        start = time.perf_counter()
        decode_seconds(model, prompts, "compiled", NEW_TOKENS)  # builds the step at the timed shapes
        compile_s[way] = round(time.perf_counter() - start, 1)
        tokens[way] = greedy(model, prompts, "compiled")
        models[way] = model
    eager = greedy(next(iter(models.values())), prompts, "eager")
    runs = alternating_tok_s(models, prompts, options.rounds, NEW_TOKENS)
    same = {way: tokens_in_common(tokens[way], eager) for way in models}
    report_copies(runs, options.out, folder=options.folder, dtype=options.dtype, quantize=options.quantize,
                  batch=options.batch, compile_s=compile_s, greedy_tokens_as_eager=same)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
