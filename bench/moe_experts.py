"""Plain experts in compiled CPU decoding: gathered into one batched product, or one by one.

    python bench/moe_experts.py FOLDER [--dtype bfloat16] [--batch 1] [--rounds 5]
                                [--out bench/results_moe_experts.jsonl]

``fast/decode_step.moe_one_token`` multiplies the chosen experts of a step with fewer assignments
than experts one by one on CPU (``CPU_EXPERTS_ONE_BY_ONE``), each product a reduction read in 8
places, where the batched product of the gathered experts is one loop read in one place per core.
One copy of the model each way, its compiled decode step built while the switch had that value
(``compile_s``), then compiled decode of 128 tokens after a 64-token prompt at ``--batch``, the
copies alternating, ``--rounds`` times. Prints (and appends to ``--out``) one JSON line: medians
and every run, tokens/s, and the first 32 greedy tokens of each copy beside the eager loop's.
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
from bench_decode_modes import alternating_tok_s, decode_seconds  # noqa: E402

from mixtral_infer import generate, load_model  # noqa: E402
from mixtral_infer.fast import decode_step  # noqa: E402

NEW_TOKENS = 128


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)
    prompts = [list(range(1 + i, 65 + i)) for i in range(options.batch)]
    models, compile_s, tokens = {}, {}, {}
    for way, one_by_one in (("gathered", False), ("one by one", True)):
        decode_step.CPU_EXPERTS_ONE_BY_ONE = one_by_one
        model = load_model(options.folder, max_batch_size=options.batch, device="cpu",
                           dtype=getattr(torch, options.dtype), pack="columns")  # fmt: skip
        start = time.perf_counter()
        decode_seconds(model, prompts, "compiled", NEW_TOKENS)  # builds the step at the timed shapes
        compile_s[way] = round(time.perf_counter() - start, 1)
        tokens[way] = generate(prompts, model, max_tokens=32, decode="compiled", prompt_logprobs=False)[0]
        models[way] = model
    tokens["eager"] = generate(prompts, models["gathered"], max_tokens=32, decode="eager", prompt_logprobs=False)[0]
    runs = alternating_tok_s(models, prompts, options.rounds, NEW_TOKENS)
    row = {"folder": options.folder, "dtype": options.dtype, "batch": options.batch,
           "torch": torch.__version__, "threads": torch.get_num_threads(), "compile_s": compile_s,
           "tok_s": {way: round(statistics.median(r), 1) for way, r in runs.items()},
           "runs": {way: [round(v, 1) for v in r] for way, r in runs.items()},
           "greedy_tokens_as_eager": {way: [a == b for a, b in zip(tokens[way][0], tokens["eager"][0])].index(False)
                                      if tokens[way][0] != tokens["eager"][0] else 32 for way in models}}  # fmt: skip
    print(json.dumps(row))
    if options.out:
        with options.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
