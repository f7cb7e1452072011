"""Whole-model decoding with the hand-written products of ``vnni_matvec.py``: how far they go.

    python bench/vnni_decode.py FOLDER [--schemes int8 int4] [--rounds 5]
                                [--out bench/results_vnni_decode.jsonl]

A measurement for the decision the quantization issue leaves open, not a path of the package.
Copies of a dense model (Mistral's layout: a mixture of experts would hand the product a gathered
expert), int8 weight-only, bfloat16 compute, each with its compiled decode step built while one
function had one meaning: ``int8 reductions``, the package as it is (``pack="columns"``, as
``main.py --decode compiled`` loads); ``int8 vnni``, plain weights (``pack=False``), whose
one-row int8 products quantize the row to 8 bits (``w8a8``'s scheme) and multiply integers with
``vpdpbusd`` (``vnni_matvec.int8_rows``, a ``torch.library`` custom op inside the compiled step).
Then compiled decode of 128 tokens after a 64-token prompt, batch 1, the copies alternating,
``--rounds`` times. Prints (and appends to ``--out``) one JSON line: medians and every run,
tokens/s, and how many of the first 32 greedy tokens each copy shares with its scheme's eager loop
(the package's kernels). A third and fourth copy do the same for int4 (groups of 32): ``int4
kernel``, the package (PyTorch's int4 kernel), and ``int4 vnni``, whose one-row products quantize
the row to int8 and multiply it by the nibbles with ``vpdpbusd`` (``vnni_matvec.int4_rows``; the
weights read back from the kernel's layout into ``vnni_matvec.int4_bytes``' once, at load).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_modes import alternating_tok_s, copies_parser, decode_seconds, report_copies  # noqa: E402
from moe_experts import NEW_TOKENS, greedy, tokens_in_common  # noqa: E402
from vnni_matvec import build, int4_bytes  # noqa: E402

from mixtral_infer import load_model  # noqa: E402
from mixtral_infer.model import linear  # noqa: E402
from mixtral_infer.quant import kernels  # noqa: E402
from mixtral_infer.quant.weights import QuantizedParameter  # noqa: E402

EXT = build()
ROWS_AS_REDUCTIONS = kernels.rows_as_reductions  # the package's, as imported
QUANTIZED_LINEAR = kernels.quantized_linear


# ``torch.ops.vnni_bench.int8_rows(xu, scale, values, scales)``, registered by the extension in C++:
# ``scale * scales * (xu - 128) @ values.T``, ``xu (IN,)`` uint8, ``values (OUT, IN)`` int8 -> ``(OUT,)``.
int8_rows = torch.ops.vnni_bench.int8_rows


@torch.library.register_fake("vnni_bench::int8_rows")
def _(xu, scale, values, scales):
    return values.new_empty(values.shape[0], dtype=torch.float32)


def vnni_rows(x: torch.Tensor, weight: torch.Tensor, scales=None) -> torch.Tensor:
    """``rows_as_reductions`` for one row times a plain int8 weight: the row quantized to int8 (plus
    128), then ``int8_rows``; anything else as the package does it."""
    plain_int8 = weight.dim() == 2 and weight.dtype == torch.int8
    if x.shape[0] != 1 or not plain_int8 or weight.shape[1] % 64 or weight.shape[0] % 8:
        return ROWS_AS_REDUCTIONS(x, weight, scales)
    scale = x.float().abs().amax() / 127  # (), as w8a8 scales a row
    xu = (torch.round(x[0].float() / scale) + 128).to(torch.uint8)  # (IN,)
    return int8_rows(xu, scale, weight.contiguous(), scales).to(x.dtype)[None]


def vnni_int4(x: torch.Tensor, weight) -> torch.Tensor:
    """``quantized_linear`` for one row times an int4 weight given ``vnni_values`` (``give_int4_layout``):
    the row quantized to int8, then ``int4_rows``; anything else as the package does it."""
    if x.shape[0] != 1 or getattr(weight, "vnni_values", None) is None or not torch.compiler.is_compiling():
        return QUANTIZED_LINEAR(x, weight)
    scale = x.float().abs().amax() / 127
    xq = torch.round(x[0].float() / scale).to(torch.int8)  # (IN,)
    start = -8 * xq.view(-1, 4).sum(-1, dtype=torch.int32)  # (IN/4,): takes the 8 of q + 8 out
    return torch.ops.vnni_bench.int4_rows(xq, scale, weight.vnni_values, weight.scales, start).to(x.dtype)[None]


@torch.library.register_fake("vnni_bench::int4_rows")
def _(xq, scale, values, scales, start):
    return values.new_empty(values.shape[0], dtype=torch.float32)


def give_int4_layout(model) -> None:
    """Each 2-D int4 weight (groups of 32) of ``model`` also held in ``vnni_matvec``'s layout, as a
    buffer ``vnni_values`` (read back from the CPU kernel's layout, which stays; the read-back knows
    that layout for rows in multiples of 64)."""
    for module in model.modules():
        if isinstance(module, QuantizedParameter) and module.scheme.name == "int4" and module.values is None:
            out_features, in_features = module.shape[-2:]
            fits = in_features % 64 == 0 and out_features % 64 == 0
            if module.scales.dim() == 2 and module.scheme.group_size == 32 and fits:
                nibbles = kernels.dequantize_int4_kernel_layout(_unit_scales(module), torch.float32)
                module.register_buffer("vnni_values", int4_bytes(nibbles.to(torch.int8)), persistent=False)


class _unit_scales:
    """``weight`` seen with every scale 1: its dequantized matrix is its integers."""

    def __init__(self, weight):
        self.packed, self.shape, self.scheme = weight.packed, weight.shape, weight.scheme
        self.scales = torch.ones_like(weight.scales)


def main(argv=None) -> int:
    parser = copies_parser(__doc__.split("\n")[0])
    parser.add_argument("--schemes", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    options = parser.parse_args(argv)
    prompts = [list(range(1, 65))]
    models, compile_s, tokens = {}, {}, {}
    copies = (("int8 reductions", "int8", ROWS_AS_REDUCTIONS, QUANTIZED_LINEAR, "columns"),
              ("int8 vnni", "int8", vnni_rows, QUANTIZED_LINEAR, False),
              ("int4 kernel", "int4", ROWS_AS_REDUCTIONS, QUANTIZED_LINEAR, "columns"),
              ("int4 vnni", "int4", ROWS_AS_REDUCTIONS, vnni_int4, "columns"))  # fmt: skip
    for way, quantize, rows, quantized_linear, pack in copies:
        if way.split()[0] not in options.schemes:
            continue
        kernels.rows_as_reductions = rows
        kernels.quantized_linear = linear.quantized_linear = quantized_linear
        model = load_model(options.folder, max_batch_size=1, device="cpu", dtype=getattr(torch, options.dtype),
                           quantize=quantize, pack=pack)  # fmt: skip
        if way == "int4 vnni":
            give_int4_layout(model)
        start = time.perf_counter()
        decode_seconds(model, prompts, "compiled", NEW_TOKENS)  # builds the step at the timed shapes
        compile_s[way] = round(time.perf_counter() - start, 1)
        tokens[way] = greedy(model, prompts, "compiled")
        models[way] = model
    kernels.rows_as_reductions = ROWS_AS_REDUCTIONS
    kernels.quantized_linear = linear.quantized_linear = QUANTIZED_LINEAR
    eager = {}  # each scheme's eager loop, through the package's own kernels (the first copy of the scheme)
    for way, model in models.items():
        eager.setdefault(way.split()[0], greedy(model, prompts, "eager"))
    runs = alternating_tok_s(models, prompts, options.rounds, NEW_TOKENS)
    same = {way: tokens_in_common(tokens[way], eager[way.split()[0]]) for way in models}
    report_copies(runs, options.out, folder=options.folder, dtype=options.dtype, batch=1,
                  compile_s=compile_s, greedy_tokens_as_eager=same)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
