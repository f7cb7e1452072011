"""The reference attention and the fast one (single queries batched) each equal dense masked
attention with xformers' own materialized bias."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixtral_infer.fast.batched_attention import (
    batched_attention,
    single_query_attention,
    single_query_gather,
    single_query_keys,
)
from mixtral_infer.model.attention import attention, one_query_sdpa, window_tiles
from mixtral_infer.model.cache import build_input_metadata
from mixtral_infer.model.xformers_bias import (
    BlockDiagonalCausalLocalAttentionFromBottomRightMask,
    BlockDiagonalCausalLocalAttentionMask,
    BlockDiagonalCausalWithOffsetPaddedKeysMask,
    BlockDiagonalMask,
)

N_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 8
BOTH = pytest.mark.parametrize("attend", [attention, batched_attention], ids=["reference", "batched"])


def dense_attention(q, k, v, bias):
    """Reference: every query against every key, masked by xformers' materialized bias."""
    mask = bias.materialize((q.shape[0], k.shape[0]), dtype=torch.float32)  # (T_q, T_k), 0 or -inf
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1]) + mask
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def random_qkv(n_q, n_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n_q, N_HEADS, HEAD_DIM, generator=g),
        torch.randn(n_k, N_KV_HEADS, HEAD_DIM, generator=g),
        torch.randn(n_k, N_KV_HEADS, HEAD_DIM, generator=g),
    )


@pytest.mark.parametrize("window", [1, 3, 16])
@BOTH
def test_first_chunk_causal_local(window, attend):
    seqlens = [5, 1, 9]
    bias = BlockDiagonalMask.from_seqlens(seqlens, device=torch.device("cpu")).make_local_attention(window)
    assert isinstance(bias, BlockDiagonalCausalLocalAttentionMask)
    q, k, v = random_qkv(sum(seqlens), sum(seqlens))
    torch.testing.assert_close(attend(q, k, v, bias), dense_attention(q, k, v, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [2, 4, 7])
@BOTH
def test_later_chunk_causal_local_from_bottom_right(window, attend):
    q_seqlens, kv_seqlens = [3, 1, 6], [3 + 4, 1 + 2, 6 + 4]
    bias = BlockDiagonalMask.from_seqlens(q_seqlens, kv_seqlens, device=torch.device("cpu"))
    bias = bias.make_local_attention_from_bottomright(window)
    assert isinstance(bias, BlockDiagonalCausalLocalAttentionFromBottomRightMask)
    q, k, v = random_qkv(sum(q_seqlens), sum(kv_seqlens))
    torch.testing.assert_close(attend(q, k, v, bias), dense_attention(q, k, v, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [100, 256, 300])
@BOTH
def test_long_blocks_run_in_query_tiles_with_the_same_result(window, attend):
    """Blocks longer than QUERY_TILE (256) go through window_tiles; the result is the dense one."""
    assert window_tiles(700, 700, 100) == [(0, 256, 0, 256), (256, 512, 157, 512), (512, 700, 413, 700)]
    first = BlockDiagonalMask.from_seqlens([700, 30], device=torch.device("cpu")).make_local_attention(window)
    later = BlockDiagonalMask.from_seqlens([600, 3], [600 + window - 1, 3 + 5], device=torch.device("cpu"))
    later = later.make_local_attention_from_bottomright(window)
    for bias, n_q, n_k in [(first, 730, 730), (later, 603, 608 + window - 1)]:
        q, k, v = random_qkv(n_q, n_k, seed=window)
        torch.testing.assert_close(attend(q, k, v, bias), dense_attention(q, k, v, bias), atol=1e-5, rtol=1e-5)


def test_single_query_keys_docstring_example():
    assert single_query_keys([(0, 5), (5, 6), (6, 40)], window=8) == ([0, 5, 32], [5, 1, 8])
    assert single_query_keys([(0, 5), (5, 6), (6, 40)], window=None) == ([0, 5, 6], [5, 1, 34])


def test_single_query_gather_docstring_example():
    index, mask, longest = single_query_gather(((0, 3), (3, 4)), None, torch.device("cpu"))
    assert index.tolist() == [0, 1, 2, 3, 3, 3] and longest == 3
    assert mask[:, 0, 0].tolist() == [[True, True, True], [True, False, False]]
    assert single_query_gather(((0, 3), (3, 6)), None, torch.device("cpu"))[1] is None  # nothing padded


def test_a_gather_made_under_inference_mode_serves_a_pass_with_gradients():
    ranges = [(0, 2), (2, 7)]
    with torch.inference_mode():
        single_query_gather(tuple(ranges), None, torch.device("cpu"))  # cached here
    k = torch.randn(7, 1, 4, requires_grad=True)
    out = single_query_attention(torch.randn(2, 2, 4), k, torch.randn(7, 1, 4), ranges, None)
    out.sum().backward()
    assert k.grad is not None and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("window", [None, 3, 6])
@BOTH
def test_serving_step_single_queries_batched_beside_prompt_chunks(window, attend):
    """A continuous-batching step: decoding sequences (one query over their cache) beside prompt
    chunks. The single queries go through one batched call; the result is the dense one."""
    q_seqlens = [1, 4, 1, 1, 7, 1]
    kv_seqlens = [1 + 9, 4 + 2, 1 + 0, 1 + 3, 7 + 0, 1 + 5]  # chunk + keys cached before it
    bias = BlockDiagonalMask.from_seqlens(q_seqlens, kv_seqlens, device=torch.device("cpu"))
    bias = bias.make_local_attention_from_bottomright(window) if window else bias.make_causal_from_bottomright()
    q, k, v = random_qkv(sum(q_seqlens), sum(kv_seqlens), seed=window or 0)
    torch.testing.assert_close(attend(q, k, v, bias), dense_attention(q, k, v, bias), atol=1e-5, rtol=1e-5)


@BOTH
def test_first_chunk_with_several_one_token_prompts(attend):
    """Top-left causal blocks of one token each (square 1 x 1) take the batched call too."""
    seqlens = [1, 5, 1, 1]
    bias = BlockDiagonalMask.from_seqlens(seqlens, device=torch.device("cpu")).make_local_attention(3)
    q, k, v = random_qkv(sum(seqlens), sum(seqlens), seed=5)
    torch.testing.assert_close(attend(q, k, v, bias), dense_attention(q, k, v, bias), atol=1e-5, rtol=1e-5)


@BOTH
def test_decode_padded_keys_with_finished_sequences(attend):
    """One query per sequence (none for the second), each over its own padded buffer of 4 keys."""
    metadata = build_input_metadata([1, 0, 1, 1], [9, 5, 1, 3], cache_size=4, sliding_window=4, device=torch.device("cpu"))
    bias = metadata.mask
    assert isinstance(bias, BlockDiagonalCausalWithOffsetPaddedKeysMask)
    q, k, v = random_qkv(3, 4 * 4)
    # Unused slots may hold anything: NaN must not leak into the result.
    k[2 * 4 + 2 : 3 * 4] = float("nan")  # sequence 2 uses 2 of its 4 slots
    v[2 * 4 + 2 : 3 * 4] = float("nan")
    k[4:8] = float("nan")  # sequence 1 takes no part in this step
    got = attend(q, k, v, bias)
    assert torch.isfinite(got).all()
    expected = dense_attention(q, torch.nan_to_num(k), torch.nan_to_num(v), bias)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@BOTH
def test_decode_with_every_slot_in_use_takes_the_unmasked_path(attend):
    metadata = build_input_metadata([1, 1], [7, 12], cache_size=4, sliding_window=4, device=torch.device("cpu"))
    q, k, v = random_qkv(2, 8, seed=3)
    torch.testing.assert_close(
        attend(q, k, v, metadata.mask), dense_attention(q, k, v, metadata.mask), atol=1e-5, rtol=1e-5
    )


def test_importing_the_package_prints_nothing_on_a_cpu_only_machine():
    """xformers' "can't load C++/CUDA extensions" warning is silenced where CUDA cannot exist."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("the warning is kept on machines with CUDA")
    result = subprocess.run(
        [sys.executable, "-c", "import mixtral_infer, mixtral_infer.model.attention; print('ok')"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.stdout == "ok\n"
    assert result.stderr == ""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("masked", [False, True], ids=["every-slot", "masked"])
def test_one_query_sdpa_attends_in_float32_on_cpu(dtype, masked):
    """One query per row, 8 query heads over 2 key/value heads: on CPU the result is SDPA's in float32
    of the same (exactly widened) inputs, rounded once to the input's dtype; PyTorch's kernel given
    16-bit inputs is slow for one query (the docstring's table) and rounds inside."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, 8, 16, generator=g).to(dtype)  # (N, H, Dh)
    keys, values = torch.randn(2, 3, 12, 2, 16, generator=g).to(dtype)  # (N, S, H_kv, Dh) each
    mask = torch.arange(12)[None, None, None, :] < torch.tensor([12, 5, 1])[:, None, None, None] if masked else None
    wide_keys, wide_values = keys.float().transpose(1, 2), values.float().transpose(1, 2)  # (N, H_kv, S, Dh)
    expected = F.scaled_dot_product_attention(
        q.float()[:, :, None], wide_keys, wide_values, attn_mask=mask, enable_gqa=True
    )[:, :, 0].to(dtype)
    got = one_query_sdpa(q, keys, values, mask)
    assert got.dtype == dtype and got.shape == (3, 8, 16)
    assert torch.equal(got, expected)
