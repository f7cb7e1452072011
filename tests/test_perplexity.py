"""Perplexity of a text (``generation/perplexity.py``): the worked example of its segments, and the
value against a naive computation, the whole segment's logits from one forward pass."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import WINDOW, random_model, tiny_args

from mixtral_infer.errors import GenerationError
from mixtral_infer.generation.perplexity import DEFAULT_CONTEXT, perplexity, text_segments

BOS = 1


def test_text_segments_worked_example():
    a, b, c, d, e, f, g = 10, 11, 12, 13, 14, 15, 16
    assert text_segments([a, b, c, d, e, f, g], 4, BOS) == [[BOS, a, b, c], [BOS, d, e, f], [BOS, g]]
    assert text_segments([a, b, c], None, BOS) == [[BOS, a, b, c]]
    assert text_segments([a, b, c], 2, BOS) == [[BOS, a], [BOS, b], [BOS, c]]


@torch.no_grad()
def naive_perplexity(model, segments) -> float:
    """Each segment's logits from one forward pass over it (no cache, no chunks), cross-entropy of
    every id after BOS."""
    nll = 0.0
    for segment in segments:
        logits = model(torch.tensor(segment[:-1]), [len(segment) - 1]).double()  # (T - 1, V)
        nll += F.cross_entropy(logits, torch.tensor(segment[1:]), reduction="sum").item()
    return math.exp(nll / sum(len(s) - 1 for s in segments))


@pytest.mark.parametrize(
    "window, context, chunk_size",
    [
        (WINDOW, None, 3),  # one segment of 51 tokens, read in chunks below the window
        (WINDOW, None, WINDOW),  # chunks equal to it
        (WINDOW, 20, 13),  # segments of 20 tokens (3 of them, the last ragged), chunks above the window
        (None, 20, 7),  # no window: segments of 20
        (None, None, None),  # no window, default context: the text is shorter than it, one segment
    ],
)
def test_perplexity_equals_one_forward_pass_over_each_segment(window, context, chunk_size):
    model = random_model(tiny_args(sliding_window=window, max_batch_size=2), seed=3)
    ids = torch.randint(3, 128, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    result = perplexity(model, ids, BOS, context=context, chunk_size=chunk_size)
    segments = text_segments(ids, context if context or window else DEFAULT_CONTEXT, BOS)
    assert (result.tokens, result.segments) == (50, len(segments))
    assert result.perplexity == pytest.approx(naive_perplexity(model, segments), rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.nll / 50))
    assert 1 < result.perplexity < 128 * 100  # a random model: far from perfect, far from nothing


def test_a_window_model_sees_past_its_window_across_one_segment():
    """The whole text as one segment is not the same as segments of the window's length: ids
    beyond the first W see earlier ids through the layers below (the rotating cache keeps W slots)."""
    model = random_model(tiny_args(sliding_window=WINDOW), seed=3)
    ids = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    whole, cut = perplexity(model, ids, BOS), perplexity(model, ids, BOS, context=WINDOW)
    assert (whole.segments, cut.segments) == (1, 6)
    assert whole.perplexity != pytest.approx(cut.perplexity, rel=1e-3)


def test_progress_is_reported_after_each_batch_of_segments():
    model = random_model(tiny_args(max_batch_size=2))
    seen = []
    perplexity(model, list(range(3, 33)), BOS, context=6, on_segments=lambda done, total: seen.append((done, total)))
    assert seen == [(2, 6), (4, 6), (6, 6)]  # 30 ids, 5 a segment, 2 segments a batch


@pytest.mark.parametrize(
    "ids, context, message",
    [
        ([], None, "no tokens to score: the text is empty"),
        ("some text", None, r"ids is text: pass its token ids, tokenizer.encode\(text, bos=False\)"),
        ([5, 500], None, r"the text has token id 500 outside the vocabulary \[0, 128\)"),
        ([5, 6], 1, "context=1 must be an integer >= 2"),
        ([5, 6], 2.5, "context=2.5 must be an integer >= 2"),
        (None, None, "ids=None must be the text's token ids"),  # were TypeErrors
        (torch.tensor([[5, 6]]), None, r"ids=tensor\(\[\[5, 6\]\]\) must be the text's token ids, a list or a 1-D"),
    ],
)
def test_bad_input_is_refused_before_any_work(ids, context, message):
    with pytest.raises(GenerationError, match=message):
        perplexity(random_model(tiny_args()), ids, BOS, context=context)


def test_bad_settings_are_refused_before_any_work():
    """on_segments=5 failed after the first batch was scored; a bos_id outside the vocabulary was
    blamed on prompt 0."""
    with pytest.raises(GenerationError, match="on_segments=5 must be a function"):
        perplexity(random_model(tiny_args()), [5, 6], BOS, on_segments=5)
    with pytest.raises(GenerationError, match=r"bos_id=500 must be a token id in \[0, 128\)"):
        perplexity(random_model(tiny_args()), [5, 6], 500)
