"""What the CPU steps' inductor options buy: fused multiply-adds (``-ffp-contract=fast``) or not.

    python bench/cpu_compile_options.py FOLDER [--dtype bfloat16] [--quantize int8] [--batch 1]
                                        [--rounds 5] [--out bench/results_cpu_compile_options.jsonl]

``steps/cpu_aot_step.CPU_INDUCTOR_OPTIONS`` builds every compiled CPU step with gcc's
``-ffp-contract=fast``, so a multiply and the add after it are one instruction; inductor's default
is ``off``. Two copies of the model, the first's decode step built with inductor's default, the
second's with the package's options, then compiled decode of 128 tokens after a 64-token prompt at
``--batch``, the copies alternating, ``--rounds`` times. Prints (and appends to ``--out``) one
JSON line: medians and every run, tokens/s, with each copy's build time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_modes import alternating_tok_s, copies_parser, decode_seconds, report_copies  # noqa: E402

from mixtral_infer import load_model  # noqa: E402
from mixtral_infer.steps import cpu_aot_step  # noqa: E402

NEW_TOKENS = 128
FLAG = "cpp.enable_floating_point_contract_flag"


def main(argv=None) -> int:
    parser = copies_parser(__doc__.split("\n")[0])
    parser.add_argument("--quantize", default=None, choices=["int8", "int4"])
    options = parser.parse_args(argv)
    prompts = [list(range(1 + i, 65 + i)) for i in range(options.batch)]
    models, compile_s = {}, {}
    package = cpu_aot_step.CPU_INDUCTOR_OPTIONS[FLAG]
    for way, flag in (("contract off (inductor's default)", "off"), (f"contract {package} (the package's)", package)):
        # the dict decode_step, the serving engine and the AOTInductor builds read when they build a step
        cpu_aot_step.CPU_INDUCTOR_OPTIONS[FLAG] = flag
        model = load_model(options.folder, max_batch_size=options.batch, device="cpu",
                           dtype=getattr(torch, options.dtype), pack="columns", quantize=options.quantize)  # fmt: skip
        start = time.perf_counter()
        decode_seconds(model, prompts, "compiled", NEW_TOKENS)  # builds the step at the timed shapes
        compile_s[way] = round(time.perf_counter() - start, 1)
        models[way] = model
    runs = alternating_tok_s(models, prompts, options.rounds, NEW_TOKENS)
    report_copies(runs, options.out, folder=options.folder, dtype=options.dtype, quantize=options.quantize,
                  batch=options.batch, compile_s=compile_s)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
