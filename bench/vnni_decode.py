"""Whole-model decoding with the hand-written products of ``vnni_matvec.py``: how far they go.

    python bench/vnni_decode.py FOLDER [--schemes int8 int4] [--batch 1] [--rounds 5]
                                [--out bench/results_vnni_decode.jsonl]

A measurement for the decision the quantization issue leaves open, not a path of the package.
Copies of a model (dense, or a mixture of experts: at batch 1 the step multiplies its two chosen
experts one by one, each read in place, the operators given the stacked weights and the expert's
index, as the package's own expert kernels are), int8 weight-only, bfloat16 compute, each with
its compiled decode step built while one function had one meaning: ``int8 reductions``, the package
as it is (``pack="columns"``, as ``main.py --decode compiled`` loads); ``int8 vnni``, plain weights
(``pack=False``), whose int8 products quantize each row to 8 bits (``w8a8``'s scheme) and
multiply integers with ``vpdpbusd`` (``torch.ops.vnni_bench.int8_rows``, an operator
``vnni_matvec.py``'s extension registers in C++, called from the compiled step; each row's sum kept
beside the weight). Then compiled decode of 128 tokens after a 64-token prompt, batch ``--batch``
(the operators take 1-8 rows, each quantized to 8 bits on its own; larger batches go to the
package's kernels), the copies alternating, ``--rounds`` times. Prints (and appends to ``--out``)
one JSON line: medians and every run, tokens/s, and how many of the first 32 greedy tokens each copy
shares with its scheme's eager loop (the package's kernels). A third and fourth copy do the same for
int4 (groups of 32): ``int4 kernel``, the package (PyTorch's int4 kernel), and ``int4 vnni``, whose
products quantize each row to int8 and multiply it by the nibbles with ``vpdpbusd``
(``int4_rows``; the weights read back from the kernel's layout into ``vnni_matvec.int4_bytes``'
once, at load).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_modes import alternating_tok_s, copies_parser, decode_seconds, report_copies  # noqa: E402
from moe_experts import NEW_TOKENS, greedy, tokens_in_common  # noqa: E402
from vnni_matvec import build, int4_bytes, int4_start, quantized_rows  # noqa: E402

from mixtral_infer import load_model  # noqa: E402
from mixtral_infer.formats import linear  # noqa: E402
from mixtral_infer.quant import kernels  # noqa: E402
from mixtral_infer.quant.weights import QuantizedParameter, QuantizedWeight  # noqa: E402

build()  # torch.ops.vnni_bench.int8_rows and int4_rows (vnni_matvec.py)
QUANTIZED_LINEAR = kernels.quantized_linear  # the package's, as imported


MAX_ROWS = 8  # what the operators take


def vnni_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """``quantized_linear`` for 1-8 rows in compiled code times a weight ``give_vnni_layouts``
    prepared: the rows quantized to int8, then ``int8_rows`` or ``int4_rows``; anything else as the
    package does it."""
    int8, int4 = getattr(weight, "vnni_sums", None), getattr(weight, "vnni_values", None)
    if x.shape[0] > MAX_ROWS or (int8 is None and int4 is None) or not torch.compiler.is_compiling():
        return QUANTIZED_LINEAR(x, weight)
    xq, scale = quantized_rows(x)  # (M, IN), (M, 1): inductor fuses it into the step
    if int8 is not None:  # an expert of stacked weights (weight.expert, a 0-d tensor) is read in place
        y = torch.ops.vnni_bench.int8_rows(xq, scale, weight.values, int8, weight.scales, weight.expert)
    else:
        y = torch.ops.vnni_bench.int4_rows(xq, scale, int4, weight.scales, int4_start(xq), weight.expert)
    return y.to(x.dtype)  # (M, OUT)


GETITEM = QuantizedWeight.__getitem__


def expert_with_layouts(self, index):
    """``QuantizedWeight.__getitem__``, the expert also carrying the stacked weight's vnni layout
    (with ``expert = index`` the product picks that expert's part)."""
    expert = GETITEM(self, index)
    for name in ("vnni_sums", "vnni_values"):
        if getattr(self, name, None) is not None:
            setattr(expert, name, getattr(self, name) if expert.expert is not None else getattr(self, name)[index])
    return expert


def give_vnni_layouts(model) -> None:
    """What the products read beside a weight of ``model``, as buffers: a plain int8 weight its
    rows' sums (``vnni_sums``); an int4 weight (groups of 32) ``vnni_matvec``'s layout
    (``vnni_values``, read back from the CPU kernel's layout, which stays; the read-back knows that
    layout for rows in multiples of 64). Stacked experts get them stacked, expert by expert."""
    for module in model.modules():
        if not isinstance(module, QuantizedParameter):
            continue
        out_features, in_features = module.shape[-2:]
        if in_features % 64 or out_features % 64:
            continue
        if module.scheme.name == "int8" and module.values is not None:
            module.register_buffer("vnni_sums", module.values.sum(-1, dtype=torch.int32), persistent=False)
        elif module.scheme.name == "int4" and module.scheme.group_size == 32 and module.values is None:
            stacked = module.scales.dim() == 3  # (E, OUT, IN/32): experts
            experts = [module[e] for e in range(module.scales.shape[0])] if stacked else [module]
            nibbles = [kernels.dequantize_int4_kernel_layout(_unit_scales(w), torch.float32) for w in experts]
            layouts = [int4_bytes(n.to(torch.int8)) for n in nibbles]  # (OUT, IN/2) each
            module.register_buffer("vnni_values", torch.stack(layouts) if stacked else layouts[0], persistent=False)


class _unit_scales:
    """``weight`` seen with every scale 1: its dequantized matrix is its integers."""

    def __init__(self, weight):
        self.packed, self.shape, self.scheme = weight.packed, weight.shape, weight.scheme
        self.scales = torch.ones_like(weight.scales)


def main(argv=None) -> int:
    parser = copies_parser(__doc__.split("\n")[0])
    parser.add_argument("--schemes", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    options = parser.parse_args(argv)
    QuantizedWeight.__getitem__ = expert_with_layouts  # an expert keeps the vnni layouts of its stack
    prompts = [list(range(1 + i, 65 + i)) for i in range(options.batch)]
    models, compile_s, tokens = {}, {}, {}
    copies = (("int8 reductions", "int8", QUANTIZED_LINEAR, "columns"), ("int8 vnni", "int8", vnni_linear, False),
              ("int4 kernel", "int4", QUANTIZED_LINEAR, "columns"), ("int4 vnni", "int4", vnni_linear, "columns"))
    for way, quantize, quantized_linear, pack in copies:
        if way.split()[0] not in options.schemes:
            continue
        kernels.quantized_linear = linear.quantized_linear = quantized_linear
        model = load_model(options.folder, max_batch_size=options.batch, device="cpu",
                           dtype=getattr(torch, options.dtype), quantize=quantize, pack=pack)  # fmt: skip
        if quantized_linear is vnni_linear:
            give_vnni_layouts(model)
        start = time.perf_counter()
        decode_seconds(model, prompts, "compiled", NEW_TOKENS)  # builds the step at the timed shapes
        compile_s[way] = round(time.perf_counter() - start, 1)
        tokens[way] = greedy(model, prompts, "compiled")
        models[way] = model
    kernels.quantized_linear = linear.quantized_linear = QUANTIZED_LINEAR
    eager = {}  # each scheme's eager loop, through the package's own kernels (the first copy of the scheme)
    for way, model in models.items():
        eager.setdefault(way.split()[0], greedy(model, prompts, "eager"))
    runs = alternating_tok_s(models, prompts, options.rounds, NEW_TOKENS)
    same = {way: tokens_in_common(tokens[way], eager[way.split()[0]]) for way in models}
    report_copies(runs, options.out, folder=options.folder, dtype=options.dtype, batch=options.batch,
                  compile_s=compile_s, greedy_tokens_as_eager=same)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
