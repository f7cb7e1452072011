"""Prefill on torch's ragged flash attention: every bias the cache makes translates to the
kernel's arguments with the same semantics as the SDPA reference path."""

from __future__ import annotations

import pytest
import torch
from test_attention import random_qkv

from mixtral_infer.fast.varlen_attention import (
    can_use_torch_varlen,
    reference_varlen_attention,
    torch_varlen_kernel,
    varlen_arguments,
    varlen_attention,
    window_size_of,
)
from mixtral_infer.model.attention import attention
from mixtral_infer.model.cache import build_input_metadata
from mixtral_infer.model.xformers_bias import (
    BlockDiagonalCausalFromBottomRightMask,
    BlockDiagonalCausalLocalAttentionFromBottomRightMask,
    BlockDiagonalCausalMask,
    BlockDiagonalMask,
)

CPU = torch.device("cpu")


def biases(device=CPU):
    """(name, bias): each block-diagonal bias type that attention() meets in prefill."""
    q, kv = [5, 1, 9], [5 + 4, 1 + 2, 9 + 3]
    yield "causal", BlockDiagonalCausalMask.from_seqlens(q, device=device)
    yield "causal local 3", BlockDiagonalCausalMask.from_seqlens(q, device=device).make_local_attention(3)
    bottom_right = BlockDiagonalMask.from_seqlens(q, kv, device=device)
    yield "causal from bottom right", bottom_right.make_causal_from_bottomright()
    yield "local 4 from bottom right", bottom_right.make_local_attention_from_bottomright(4)
    for chunk, seen, window in [(3, 10, 4), (4, 4, 4), (9, 6, 4), (1, 0, 4), (6, 0, 4)]:  # chunk <, = and > the window
        # split=False: the one-part bias a CUDA pass attends with (on CPU a one-token chunk beside others splits)
        metadata = build_input_metadata([chunk, 2], [seen, 1], window, window, device, split=False)
        yield f"cache: chunk {chunk} after {seen}, window {window}", metadata.mask
    first = build_input_metadata([6, 2], [0, 0], cache_size=4, sliding_window=4, device=device)
    yield "cache: first chunk, window 4", first.mask


def sizes(bias):
    """(T_q, T_k) of a block-diagonal bias."""
    return bias.q_seqinfo.seqstart_py[-1], bias.k_seqinfo.seqstart_py[-1]


def test_window_sizes_follow_the_table():
    q, kv = [2, 3], [4, 3]
    with pytest.raises(NotImplementedError, match="only causal"):
        window_size_of(BlockDiagonalMask.from_seqlens(q, kv))  # the cache never makes a non-causal bias
    assert window_size_of(BlockDiagonalCausalMask.from_seqlens(q)) == (-1, 0)
    assert window_size_of(BlockDiagonalCausalMask.from_seqlens(q).make_local_attention(5)) == (4, 0)
    bottom_right = BlockDiagonalMask.from_seqlens(q, kv)
    assert isinstance(bottom_right.make_causal_from_bottomright(), BlockDiagonalCausalFromBottomRightMask)
    assert window_size_of(bottom_right.make_causal_from_bottomright()) == (-1, 0)
    local = bottom_right.make_local_attention_from_bottomright(3)
    assert isinstance(local, BlockDiagonalCausalLocalAttentionFromBottomRightMask)
    assert window_size_of(local) == (2, 0)


def test_worked_example_two_queries_over_three_cached_and_two_new_keys():
    """Window 3: query 0 (at key 3) sees keys 1..3, query 1 sees keys 2..4."""
    bias = BlockDiagonalMask.from_seqlens([2], [5]).make_local_attention_from_bottomright(3)
    q = torch.zeros(2, 1, 4)  # equal scores: each output is the mean of the visible values
    k = torch.zeros(5, 1, 4)
    v = torch.arange(5.0)[:, None, None].expand(5, 1, 4)
    out = varlen_attention(q, k, v, bias, reference_varlen_attention)
    assert out[:, 0, 0].tolist() == pytest.approx([2.0, 3.0])


@pytest.mark.parametrize("case", list(biases()), ids=lambda case: case[0])
def test_translation_equals_the_sdpa_path(case):
    bias = case[1]
    n_q, n_k = sizes(bias)
    assert isinstance(bias, BlockDiagonalMask)
    q, k, v = random_qkv(n_q, n_k, seed=n_q + n_k)
    expected = attention(q, k, v, bias)
    got = varlen_attention(q, k, v, bias, reference_varlen_attention)  # GQA through repeat_interleave
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    args = varlen_arguments(bias, CPU)
    with_gqa = reference_varlen_attention(
        q, k, v, args.cu_seq_q, args.cu_seq_k, args.max_q, args.max_k, window_size=args.window_size, enable_gqa=True
    )
    torch.testing.assert_close(with_gqa, expected, atol=1e-5, rtol=1e-5)


def test_cpu_tensors_never_take_the_cuda_kernel():
    bias = BlockDiagonalCausalMask.from_seqlens([3])
    assert not can_use_torch_varlen(torch.zeros(3, 2, 8, dtype=torch.bfloat16), bias)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen flash attention runs on CUDA only; no GPU here")
def test_the_cuda_kernel_equals_the_sdpa_path_on_every_bias():
    if torch_varlen_kernel() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    device = torch.device("cuda")
    for name, bias in biases(device):
        n_q, n_k = sizes(bias)
        q, k, v = (t.to(device, torch.bfloat16) for t in random_qkv(n_q, n_k, seed=n_q + n_k))
        assert can_use_torch_varlen(q, bias), name
        got = varlen_attention(q, k, v, bias, torch_varlen_kernel())
        expected = attention(q.float(), k.float(), v.float(), bias)
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2, msg=name)
