"""One timed run of mixtral_infer on a benchmark model folder, for the llama.cpp side-by-side.

Our side of ``bench/llamacpp/run_compare.py`` (which calls it), with ``--quantize int8|int4`` for
llama.cpp's Q8_0 / Q4_0 peers:

    python bench/ours_run.py HF_FOLDER --dtype bfloat16 --quantize int8

Prints one JSON line: decode_s (128 greedy new tokens after a 64-token prompt, decode loop only,
batch 1) and prefill_s (one 2048-token prompt, default chunk, last logit only), each after a warm-up.

``--decode loop`` (the default) times ``model(tokens, seqlens, cache).argmax(-1)`` per token, the
eager path with no bookkeeping, as the first comparison did. ``--decode compiled`` times
``generate(..., decode="compiled")`` from its first new token to its last (127 steps, sampling and
streaming included) after a warm-up call that compiles (``compile_s``), with the weights loaded plain
as ``main.py --decode compiled`` loads them (``packed``: "columns", long rows in column blocks;
``fast/cpu_reductions.py`` and ``fast/cpu_column_blocks.py`` say why).
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_vs_transformers as b  # noqa: E402
from bench_decode_modes import decode_seconds  # noqa: E402  (first new token to last)

from mixtral_infer import load_model  # noqa: E402
from mixtral_infer.generation.generate import default_chunk_size  # noqa: E402
from mixtral_infer.serve.sizing import weight_bytes  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--quantize", default=None, help="int8, int4, int4-128 or nf4 (weights only; compute in --dtype), or w8a8 (int8 activations too)"
    )
    parser.add_argument("--what", nargs="+", default=["decode", "prefill"])
    parser.add_argument("--decode", default="loop", choices=["loop", "eager", "static", "compiled"])
    cli = parser.parse_args()
    start = time.perf_counter()
    pack = "columns" if cli.decode == "compiled" else True  # as the CLI loads for each --decode
    dtype = getattr(torch, cli.dtype)
    model = load_model(cli.folder, max_batch_size=1, device="cpu", dtype=dtype, quantize=cli.quantize, pack=pack)
    out = {"dtype": cli.dtype, "quantize": cli.quantize, "load_s": time.perf_counter() - start, "threads": torch.get_num_threads(),
           "weights_bytes": weight_bytes(model), "packed": pack}  # fmt: skip
    if cli.quantize is None:
        out["decode_bytes_b1"] = b.decode_bytes(model, 1)["bytes"]
    vocab = model.args.vocab_size
    prompts = b.random_prompts(1, b.PROMPT_LEN, vocab, seed=1001)
    if "decode" in cli.what and cli.decode == "loop":
        b.ours_decode(model, prompts, 16)  # warm-up
        out["decode_s"], _ = b.ours_decode(model, prompts, b.NEW_TOKENS)
        out["decode_tok_s"] = b.NEW_TOKENS / out["decode_s"]
    elif "decode" in cli.what:
        start = time.perf_counter()
        decode_seconds(model, prompts, cli.decode, b.NEW_TOKENS)  # warm-up (compiles)
        out["compile_s"] = time.perf_counter() - start
        out["decode_s"] = decode_seconds(model, prompts, cli.decode, b.NEW_TOKENS)
        out["decode_tok_s"] = (b.NEW_TOKENS - 1) / out["decode_s"]
    out["decode"] = cli.decode
    if "prefill" in cli.what:
        prompt = b.random_prompts(1, b.PREFILL_LEN, vocab, seed=7)[0]
        window = model.args.sliding_window or b.PREFILL_LEN
        b.ours_chunked_prefill(model, prompt[:window], window)  # warm-up
        start = time.perf_counter()
        b.ours_chunked_prefill(model, prompt, default_chunk_size(1))
        out["prefill_s"] = time.perf_counter() - start
        out["prefill_tok_s"] = b.PREFILL_LEN / out["prefill_s"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
