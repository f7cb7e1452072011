"""The serving bench's helpers: paired ratios and the tokenizer that folds a larger vocabulary."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_serve import FoldedTokenizer, paired_ratios  # noqa: E402


def test_paired_ratios_docstring_example():
    """Round 1: 300 / 100, round 2: 200 / 200: the median of 3.0 and 1.0 (not 250 / 150)."""
    assert paired_ratios({"engine": [300, 200], "static": [100, 200]}) == {"engine/static": 2.0}
    both = paired_ratios({"continuous": [4, 6, 8], "static": [2, 2, 2], "sequential": [1, 1, 2]})
    assert both == {"continuous/static": 3.0, "continuous/sequential": 4.0}


def test_folded_tokenizer_decodes_ids_beyond_its_vocabulary():
    tokenizer = FoldedTokenizer.from_folder("tiny-mixtral")
    n = tokenizer.n_words
    ids = tokenizer.encode("And the LORD spake", bos=False)
    assert tokenizer.decode([i + n for i in ids]) == tokenizer.decode(ids) == "And the LORD spake"
    assert tokenizer.id_to_piece(ids[0] + 3 * n) == tokenizer.id_to_piece(ids[0])
