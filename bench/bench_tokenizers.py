"""Encoding speed of the three tokenizer back-ends, through ``Tokenizer.encode``, in one process.

    python bench/bench_tokenizers.py --out bench/results_tokenizers.json

The text: ``tests/data/kjv_heldout.txt`` repeated to 1 MB. The tokenizers: Mistral's tekken file
(mistral-common's ``tekken_240911.json``, 131,072 ids) read by mistral-common (tiktoken inside);
the same file written as a ``tokenizer.json`` (``checkpoint.hf_tokenizer.tekken_tokenizer_json``)
read by Hugging Face's tokenizers; and the shipped tiny-mixtral ``tokenizer.model`` (sentencepiece,
2,000 pieces: tokens are shorter, so there are more of them per MB). Each round encodes the text
once with each, in turn; tokens/s and MB/s are the median of ``--rounds`` rounds after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_vs_transformers import machine_info  # noqa: E402

from mixtral_infer import Tokenizer  # noqa: E402
from mixtral_infer.checkpoint.hf_tokenizer import tekken_tokenizer_json  # noqa: E402
from mixtral_infer.shipped import SHIPPED_MODELS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MB = 1_000_000


def one_megabyte() -> str:
    text = (REPO / "tests" / "data" / "kjv_heldout.txt").read_text(encoding="utf-8")
    text = text * (MB // len(text.encode("utf-8")) + 1)
    return text.encode("utf-8")[:MB].decode("utf-8", errors="ignore")


def tokenizers(folder: Path) -> dict:
    import mistral_common

    tekken_path = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"
    tekken = Tokenizer(tekken_path)
    (folder / "tokenizer.json").write_text(json.dumps(tekken_tokenizer_json(tekken.file)), encoding="utf-8")
    return {
        "tekken (mistral-common)": tekken,
        "tokenizer.json (tokenizers)": Tokenizer(folder / "tokenizer.json"),
        "sentencepiece (tiny-mixtral, 2,000 pieces)": Tokenizer(SHIPPED_MODELS / "tiny-mixtral" / "tokenizer.model"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    options = parser.parse_args()
    import mistral_common
    import sentencepiece
    import tiktoken
    import tokenizers as hf_tokenizers

    text = one_megabyte()
    with tempfile.TemporaryDirectory() as folder:
        chosen = tokenizers(Path(folder))
        counts = {name: len(tokenizer.encode(text, bos=False)) for name, tokenizer in chosen.items()}  # the warm-up
        seconds = {name: [] for name in chosen}
        for _ in range(options.rounds):
            for name, tokenizer in chosen.items():
                start = time.perf_counter()
                tokenizer.encode(text, bos=False)
                seconds[name].append(time.perf_counter() - start)
    rows = {}
    print(f"{'tokenizer':45} {'tokens':>9} {'tokens/s':>12} {'MB/s':>7}")
    for name, runs in seconds.items():
        median = statistics.median(runs)
        rows[name] = {"tokens": counts[name], "seconds": runs, "tokens_per_s": counts[name] / median, "mb_per_s": len(text.encode()) / MB / median}
        print(f"{name:45} {counts[name]:>9,} {rows[name]['tokens_per_s']:>12,.0f} {rows[name]['mb_per_s']:>7.2f}")
    result = {
        "text_bytes": len(text.encode("utf-8")),
        "rounds": options.rounds,
        "results": rows,
        "versions": {"mistral_common": mistral_common.__version__, "tiktoken": tiktoken.__version__,
                     "tokenizers": hf_tokenizers.__version__, "sentencepiece": sentencepiece.__version__},  # fmt: skip
        "machine": machine_info(),
    }
    if options.out is not None:
        options.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
