"""Quality of the quantized shipped models: held-out perplexity against their bfloat16 selves.

The held-out text is the last 2% of the King James Bible's verses (``tests/data/kjv_heldout.txt``,
public domain; the split ``scripts/train_small.py`` scores the shipped models on), scored by that
script's ``model_perplexity``. Over all 24,898 held-out tokens (README): tiny-mixtral bfloat16
34.11, int8 34.11, int4 34.95 (+2.5%); tiny-mistral 34.25, 34.24, 35.49 (+3.6%); w8a8 in the README. The test scores
the first eighth of the verses (3,300 tokens) to stay fast: there tiny-mixtral
40.77 / 40.73 / 41.69 (+2.3%), tiny-mistral 40.31 / 40.32 / 42.06 (+4.3%).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from mixtral_infer import load_model
from mixtral_infer.shipped import SHIPPED_MODELS

REPO = Path(__file__).resolve().parents[1]
HELDOUT = REPO / "tests" / "data" / "kjv_heldout.txt"
BOUNDS = {"int8": 1.01, "w8a8": 1.01, "int4": 1.05, "nf4": 1.05}  # the issue's: int8 within +1% of bfloat16 (w8a8 too), 4-bit within +5%


def train_small():
    spec = importlib.util.spec_from_file_location("train_small", REPO / "scripts" / "train_small.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_small"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def heldout():
    script = train_small()
    lines = HELDOUT.read_text(encoding="utf-8").splitlines()
    tokenizer = spm.SentencePieceProcessor(model_file=str(SHIPPED_MODELS / "tiny-mixtral" / "tokenizer.model"))
    assert len(script.encode_lines(tokenizer, lines).tokens) == 24898  # the held-out set of the shipped README
    return script, script.encode_lines(tokenizer, lines[: len(lines) // 8])


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-mistral"])
def test_quantized_perplexity_stays_within_the_bounds(heldout, name):
    script, stream = heldout
    perplexity = {
        scheme: script.model_perplexity(load_model(name, dtype=torch.bfloat16, quantize=scheme), stream, seq_len=128, batch_size=64)
        for scheme in (None, *BOUNDS)
    }
    assert 25 < perplexity[None] < 45  # the bfloat16 model predicts this text (unigram baseline: 397)
    for scheme, bound in BOUNDS.items():
        assert perplexity[scheme] <= bound * perplexity[None], perplexity
