"""Our logits equal transformers' on the same weights, on every path through the cache."""

from __future__ import annotations

import pytest
import torch
from conftest import WINDOW, random_model, tiny_args

from mixtral_infer import forward
from mixtral_infer.errors import GenerationError

TOLERANCE = 1e-4


def random_prompts(lengths, vocab_size, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_logits(hf, sequence):
    with torch.no_grad():
        return hf(torch.tensor([sequence])).logits[0].float()  # (T, V)


def cached_logits(model, sequences, prefix_lengths, chunk_size):
    """Logits at every position: chunked prefill of each prefix, then one token per step.

    Sequences that run out sit later chunks and steps out (length 0).
    """
    batch = len(sequences)
    cache = model.make_cache(batch, max_seqlen=max(len(s) for s in sequences))
    cache.start_sequences(batch)
    collected = [[] for _ in range(batch)]
    with torch.no_grad():
        for start in range(0, max(prefix_lengths), chunk_size):
            chunks = [s[start : min(start + chunk_size, p)] for s, p in zip(sequences, prefix_lengths)]
            _run(model, cache, chunks, collected)
        for step in range(max(len(s) - p for s, p in zip(sequences, prefix_lengths))):
            chunks = [s[p + step : p + step + 1] for s, p in zip(sequences, prefix_lengths)]
            _run(model, cache, chunks, collected)
    return [torch.cat(rows) for rows in collected]


def _run(model, cache, chunks, collected):
    seqlens = [len(c) for c in chunks]
    logits = model(torch.tensor([t for c in chunks for t in c], dtype=torch.long), seqlens, cache)
    for i, part in enumerate(torch.split(logits, seqlens)):
        collected[i].append(part)


@pytest.mark.parametrize("chunk_size", [3, WINDOW, 13], ids=["chunk<W", "chunk=W", "chunk>W"])
def test_chunked_prefill_and_decoding_match_transformers(model_pair, chunk_size):
    ours, hf, args = model_pair
    lengths = [4 * WINDOW + 5, 3 * WINDOW + 2, 7, 2 * WINDOW]
    prefixes = [3 * WINDOW + 1, 11, 7, 1]  # the last one decodes 15 tokens, the third none
    sequences = random_prompts(lengths, args.vocab_size)
    got = cached_logits(ours, sequences, prefixes, chunk_size)
    for sequence, logits in zip(sequences, got):
        expected = hf_logits(hf, sequence)
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max().item() <= TOLERANCE


def test_forward_without_cache_matches_transformers(model_pair):
    ours, hf, args = model_pair
    sequences = random_prompts([5 * WINDOW, 9, 1], args.vocab_size, seed=1)
    with torch.no_grad():
        logits = ours(torch.tensor(sum(sequences, [])), [len(s) for s in sequences])
    for sequence, part in zip(sequences, torch.split(logits, [len(s) for s in sequences])):
        assert (part - hf_logits(hf, sequence)).abs().max().item() <= TOLERANCE


def test_logits_are_far_from_uniform(model_pair):
    """Guards the parity tests against weights so small that every model agrees."""
    ours, _, args = model_pair
    logits = ours(torch.tensor(random_prompts([20], args.vocab_size)[0]), [20])
    assert logits.std(dim=-1).min().item() > 0.5


def test_logit_rows_select_rows_of_the_full_logits(model_pair):
    """A ragged chunk with a cache: ``logit_rows`` gives those rows of the full logits, nothing else changes."""
    ours, _, args = model_pair
    chunks = random_prompts([WINDOW + 3, 1, 5], args.vocab_size, seed=9)
    seqlens = [len(c) for c in chunks]
    input_ids = torch.tensor(sum(chunks, []))
    rows = [WINDOW + 2, WINDOW + 3, 0, len(input_ids) - 1]
    caches = [ours.make_cache(3), ours.make_cache(3)]
    with torch.no_grad():
        for cache in caches:
            cache.start_sequences(3)
        full = ours(input_ids, seqlens, caches[0])  # (T, V)
        some = ours(input_ids, seqlens, caches[1], logit_rows=rows)  # (4, V)
        none = ours(input_ids[:2], [2, 0, 0], ours.make_cache(3), logit_rows=[])
    assert some.shape == (len(rows), args.vocab_size)
    assert (some - full[rows]).abs().max().item() <= 1e-5
    assert none.shape == (0, args.vocab_size)
    assert caches[0].tokens_seen == caches[1].tokens_seen
    for layer in range(args.n_layers):
        assert torch.equal(caches[0].cache_k[layer], caches[1].cache_k[layer])


def test_logit_rows_out_of_range_is_refused(model_pair):
    ours, _, args = model_pair
    with pytest.raises(ValueError, match=r"logit_rows=\[3\] must index the 3 input_ids"):
        forward(ours, torch.tensor([5, 6, 7]), [3], logit_rows=[3])


@pytest.mark.parametrize(
    "args, message",
    [  # each was torch's or Python's own error (an arange's step sign, an embedding's index, a list's .dim)
        (([1, 5, 9], [3]), "input_ids must be a 1-D tensor of every sequence's token ids, concatenated; got list"),
        ((torch.tensor([1.0, 5.0]), [2]), "input_ids must be an integer tensor of token ids, got torch.float32"),
        ((torch.tensor([1, 5, 9]), [-1, 4]), r"seqlens=\[-1, 4\] must be lengths >= 0 that add up to the 3 input_ids"),
        ((torch.tensor([1, 5, 9]), [3.0]), r"seqlens=\[3.0\] must be a list of integers"),
        ((torch.tensor([1, 5, 9]), 3), "seqlens=3 must be a list of integers"),
        ((torch.tensor([1, 128, 9]), [3]), r"input_ids has token id 128 outside the vocabulary \[0, 128\)"),
    ],
)
def test_forward_names_an_input_it_cannot_take(args, message):
    ours = random_model(tiny_args(moe=False))
    with pytest.raises(GenerationError, match=message):
        forward(ours, *args)  # the model's own forward checks nothing


def test_forward_takes_tensors_of_lengths_and_rows_not_masks_or_short_caches():
    """A mask of bools was read as rows 0 and 1, 2.7 as row 2; a cache of fewer slots than the
    window silently became a shorter window."""
    ours = random_model(tiny_args(moe=False))
    args = ours.args
    ids = torch.tensor(random_prompts([12], args.vocab_size, seed=2)[0])
    expected = ours(ids, [12], logit_rows=[3, 11])
    torch.testing.assert_close(forward(ours, ids, torch.tensor([12]), logit_rows=torch.tensor([3, 11])), expected)
    for rows in (torch.arange(12) % 2 == 0, [2.7]):
        with pytest.raises(GenerationError, match="logit_rows=.* must be a list of integers"):
            forward(ours, ids, [12], logit_rows=rows)
    short = ours.make_cache(1, max_seqlen=WINDOW // 2)
    with pytest.raises(GenerationError, match=rf"the cache holds {WINDOW // 2} slots per sequence, but sequence 0 needs {WINDOW}"):
        forward(ours, ids, [12], cache=short)
    with pytest.raises(GenerationError, match="cache=5 must be a cache from model.make_cache"):
        forward(ours, ids, [12], cache=5)
