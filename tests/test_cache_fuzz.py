"""Property-based tests: the rotating cache against a naive cache that keeps every sequence's full history.

Random windows, batch sizes, ragged prompts (sequences sit chunks out once their
prompt is done), chunk sizes and decode steps. After every step:

* each sequence's unrotated cache equals the last ``min(W, length)`` keys of its history;
* attention through the cache (``Attention.attend``, as the model does it) equals dense
  masked attention over the full history, with every unused cache slot holding NaN; a step
  that mixes one-token sequences with longer chunks attends in two parts or in one
  (``split_mixed``: off CUDA and on it).
"""

from __future__ import annotations

import copy
import math
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixtral_infer import RotatingBufferCache, unrotate
from mixtral_infer.formats.modules import FastAttention
from mixtral_infer.model import cache as cache_module
from mixtral_infer.model.transformer import Attention, ModelArgs

N_HEADS, N_KV_HEADS, HEAD_DIM = 2, 1, 4
# attend() reads no weight: one layer's module of these head counts attends as the model's do
ATTENTION = Attention(ModelArgs(dim=8, n_layers=1, head_dim=HEAD_DIM, hidden_dim=8, n_heads=N_HEADS,
                                n_kv_heads=N_KV_HEADS, norm_eps=1e-5, vocab_size=8))  # fmt: skip
FAST_ATTENTION = copy.deepcopy(ATTENTION)
FAST_ATTENTION.__class__ = FastAttention


def reference_attention(q, history_k, history_v, positions, window):
    """Each query at position p over history positions p-W+1 .. p; q (T_b, H, D)."""
    out = torch.empty_like(q)
    for row, p in enumerate(positions):
        lo = max(0, p - window + 1)
        k = history_k[lo : p + 1].repeat_interleave(N_HEADS // N_KV_HEADS, dim=1)  # (n, H, D)
        v = history_v[lo : p + 1].repeat_interleave(N_HEADS // N_KV_HEADS, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row], k) / math.sqrt(HEAD_DIM)
        out[row] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out


@st.composite
def scenarios(draw):
    window = draw(st.integers(1, 6))
    batch = draw(st.integers(1, 10))  # more than LOOP_MAX_SEQUENCES: FastAttention gathers
    prompt_lengths = draw(st.lists(st.integers(1, 4 * window + 3), min_size=batch, max_size=batch))
    chunk_size = draw(st.integers(1, 3 * window + 2))
    decode_steps = draw(st.integers(0, 2 * window + 2))
    # Which sequences take part in each decode step (a finished sequence sits out).
    participation = draw(
        st.lists(st.lists(st.booleans(), min_size=batch, max_size=batch), min_size=decode_steps, max_size=decode_steps)
    )
    return window, prompt_lengths, chunk_size, participation


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.integers(0, 2**31 - 1), st.booleans(), st.booleans())
def test_rotating_cache_matches_full_history(scenario, seed, split, fast):
    """The reference module's attention, and the fast module's (keys gathered by index beyond
    LOOP_MAX_SEQUENCES sequences), each against the full history."""
    window, prompt_lengths, chunk_size, participation = scenario
    attention = FAST_ATTENTION if fast else ATTENTION
    with mock.patch.object(cache_module, "split_mixed", cache_module.split_mixed if split else lambda *_: None):
        check_against_full_history(window, prompt_lengths, chunk_size, participation, seed, attention)


def check_against_full_history(window, prompt_lengths, chunk_size, participation, seed, attention):
    batch = len(prompt_lengths)
    generator = torch.Generator().manual_seed(seed)
    cache = RotatingBufferCache(1, batch, window, N_KV_HEADS, HEAD_DIM, sliding_window=window)
    cache.cache_k.fill_(float("nan"))
    cache.cache_v.fill_(float("nan"))
    cache.start_sequences(batch)
    history_k = [torch.empty(0, N_KV_HEADS, HEAD_DIM) for _ in range(batch)]
    history_v = [torch.empty(0, N_KV_HEADS, HEAD_DIM) for _ in range(batch)]

    steps = []
    for start in range(0, max(prompt_lengths), chunk_size):
        steps.append([max(0, min(chunk_size, n - start)) for n in prompt_lengths])
    steps += [[int(takes_part) for takes_part in row] for row in participation]

    for seqlens in steps:
        if sum(seqlens) == 0:
            continue
        total = sum(seqlens)
        q = torch.randn(total, N_HEADS, HEAD_DIM, generator=generator)
        xk = torch.randn(total, N_KV_HEADS, HEAD_DIM, generator=generator)
        xv = torch.randn(total, N_KV_HEADS, HEAD_DIM, generator=generator)

        metadata = cache.get_input_metadata(seqlens)
        out = attention.attend(q, xk, xv, cache.get_view(0, metadata), None)
        cache.advance(seqlens)

        offset = 0
        for b, n in enumerate(seqlens):
            if n == 0:
                continue
            seen = history_k[b].shape[0]
            history_k[b] = torch.cat([history_k[b], xk[offset : offset + n]])
            history_v[b] = torch.cat([history_v[b], xv[offset : offset + n]])
            expected = reference_attention(q[offset : offset + n], history_k[b], history_v[b], range(seen, seen + n), window)
            torch.testing.assert_close(out[offset : offset + n], expected, atol=1e-5, rtol=1e-5)
            offset += n

        for b in range(batch):
            length = history_k[b].shape[0]
            assert cache.tokens_seen[b] == length
            kept = min(window, length)
            torch.testing.assert_close(unrotate(cache.cache_k[0, b], length), history_k[b][length - kept :])
            torch.testing.assert_close(unrotate(cache.cache_v[0, b], length), history_v[b][length - kept :])
