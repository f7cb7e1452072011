"""Held-out perplexity of the shipped models with int4 weights and 8-bit rows, as ``vnni_matvec``'s
int4 product computes: the quality side of the decision that bench measures the speed of.

    python bench/w4a8_quality.py [--out bench/results_w4a8_quality.json]

``vnni_matvec.int4_rows`` quantizes each row of activations to int8 (``round(127 x / max|x|)``, as
``w8a8`` does) before multiplying it by the int4 weight. Here every product of an int4 model does
the same in float32 (the row rounded to its 8-bit values and scaled back, times the dequantized
weight: what the kernel's integer sums give, up to the order of float32 additions), and the model
is scored as ``tests/test_quant_quality.py`` scores it, over all 24,898 held-out tokens (README,
"Quantized weights"), in float32 (int4 weights in float32 keep their plain integers, which the
dequantized product reads; in bfloat16 the CPU kernel's layout replaces them). Prints one JSON line:
perplexity in float32, int4 (groups of 32), and int4 with 8-bit rows, per model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sentencepiece as spm
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))
from test_quant_quality import HELDOUT, train_small  # noqa: E402
from vnni_matvec import quantized_rows  # noqa: E402

from mixtral_infer import load_model  # noqa: E402
from mixtral_infer.formats import linear  # noqa: E402
from mixtral_infer.shipped import SHIPPED_MODELS  # noqa: E402

QUANTIZED_LINEAR = linear.quantized_linear


def eight_bit_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row of ``x (M, IN)`` rounded to 127 steps of its largest magnitude, in float32."""
    xq, scale = quantized_rows(x)  # (M, IN), (M, 1)
    return xq.float() * scale


def int4_with_eight_bit_rows(x: torch.Tensor, weight) -> torch.Tensor:
    """``quantized_linear`` for int4 weights with the rows quantized first; others as the package."""
    if weight.scheme.name != "int4":
        return QUANTIZED_LINEAR(x, weight)
    return (eight_bit_rows(x) @ weight.resolved().dequantize().T).to(x.dtype)  # (M, OUT)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args(argv)
    script = train_small()
    lines = HELDOUT.read_text(encoding="utf-8").splitlines()
    result = {"torch": torch.__version__, "tokens": None, "perplexity": {}}
    for name in ("tiny-mixtral", "tiny-mistral"):
        tokenizer = spm.SentencePieceProcessor(model_file=str(SHIPPED_MODELS / name / "tokenizer.model"))
        stream = script.encode_lines(tokenizer, lines)
        result["tokens"] = len(stream.tokens)
        scores = {}
        for way, quantize, product in (("float32", None, QUANTIZED_LINEAR), ("int4", "int4", QUANTIZED_LINEAR),
                                       ("int4, 8-bit rows", "int4", int4_with_eight_bit_rows)):  # fmt: skip
            linear.quantized_linear = product
            model = load_model(name, dtype=torch.float32, quantize=quantize)
            with torch.no_grad():
                scores[way] = round(script.model_perplexity(model, stream, seq_len=128, batch_size=64), 2)
        linear.quantized_linear = QUANTIZED_LINEAR
        result["perplexity"][name] = scores
    print(json.dumps(result))
    if options.out:
        options.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
