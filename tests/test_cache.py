"""The rotating cache against the worked examples of 猛猿's article "图解Mixtral 8 * 7b推理优化原理与源码实现"
(Mixtral 8x7b inference optimisation explained, with source code; see cache.py)."""

from __future__ import annotations

import pytest
import torch

from mixtral_infer import RotatingBufferCache, interleave_list, unrotate
from mixtral_infer.fast.cache_gather import LOOP_MAX_SEQUENCES, gather_kv, gathered_kv, kv_gather
from mixtral_infer.model.cache import build_input_metadata, split_mixed
from mixtral_infer.model.xformers_bias import (
    BlockDiagonalCausalLocalAttentionFromBottomRightMask,
    BlockDiagonalCausalLocalAttentionMask,
    BlockDiagonalCausalWithOffsetPaddedKeysMask,
)


def position_cache(window: int, batch: int) -> RotatingBufferCache:
    """A one-layer cache with one KV head of size 1, so each slot holds a single number."""
    cache = RotatingBufferCache(1, batch, window, n_kv_heads=1, head_dim=1, sliding_window=window)
    cache.start_sequences(batch)
    return cache


def write_chunk(cache: RotatingBufferCache, seqlens: list[int]) -> None:
    """Write a chunk whose keys are the tokens' own positions, as the model would (update, then count)."""
    metadata = cache.get_input_metadata(seqlens)
    keys = metadata[0].positions.float()[:, None, None]  # (T, 1, 1)
    cache.get_view(0, metadata).update(keys, keys)
    cache.advance(seqlens)


def slots(cache: RotatingBufferCache, b: int) -> list[int]:
    return cache.cache_k[0, b, :, 0, 0].long().tolist()


def test_chunk_larger_than_window_keeps_last_w_positions_in_rotated_slots():
    """W=3, chunk 5: prompt 0 holds [3, 4, 2] after chunk 0 and [9, 7, 8] after chunk 1."""
    cache = position_cache(window=3, batch=1)
    write_chunk(cache, [5])
    assert slots(cache, 0) == [3, 4, 2]
    write_chunk(cache, [5])
    assert slots(cache, 0) == [9, 7, 8]
    assert unrotate(cache.cache_k[0, 0], 10)[:, 0, 0].long().tolist() == [7, 8, 9]


def test_ragged_chunk_rotates_and_unrotates():
    """W=4, three prompts prefilled in chunks of 4; the last chunk has lengths [4, 2, 1]."""
    cache = position_cache(window=4, batch=3)
    write_chunk(cache, [4, 4, 4])
    write_chunk(cache, [4, 4, 4])
    write_chunk(cache, [4, 2, 1])
    assert slots(cache, 0) == [8, 9, 10, 11]
    assert slots(cache, 1) == [8, 9, 6, 7]
    assert slots(cache, 2) == [8, 5, 6, 7]
    assert unrotate(cache.cache_k[0, 1], 10)[:, 0, 0].long().tolist() == [6, 7, 8, 9]
    assert unrotate(cache.cache_k[0, 2], 9)[:, 0, 0].long().tolist() == [5, 6, 7, 8]


def test_metadata_worked_example():
    """chunk_lengths [5, 7, 2] at positions [0, 1, 3], W=3 (the example in cache.py's docstring)."""
    metadata = build_input_metadata([5, 7, 2], [0, 1, 3], cache_size=3, sliding_window=3, device=torch.device("cpu"))
    assert metadata.positions.tolist() == [0, 1, 2, 3, 4, 1, 2, 3, 4, 5, 6, 7, 3, 4]
    assert metadata.to_cache_mask.tolist() == [False, False, True, True, True] + [False] * 4 + [True] * 5
    assert metadata.cache_positions.tolist() == [2, 0, 1, 5, 3, 4, 6, 7]
    assert metadata.to_cache_rows.tolist() == [2, 3, 4, 9, 10, 11, 12, 13]
    assert not metadata.decoding
    assert isinstance(metadata.mask, BlockDiagonalCausalLocalAttentionFromBottomRightMask)
    # Sequence 0 has nothing cached; sequence 1 has 1 token, sequence 2 has 3 (clamped to W=3).
    assert metadata.mask.k_seqinfo.seqstart_py == [0, 5, 5 + 8, 5 + 8 + 5]


def test_first_chunk_uses_causal_local_mask_and_decode_uses_padded_keys():
    first = build_input_metadata([4, 2], [0, 0], cache_size=4, sliding_window=4, device=torch.device("cpu"))
    assert isinstance(first.mask, BlockDiagonalCausalLocalAttentionMask)
    assert first.nothing_cached and not first.decoding
    decode = build_input_metadata([1, 0, 1], [9, 5, 2], cache_size=4, sliding_window=4, device=torch.device("cpu"))
    assert decode.decoding
    assert isinstance(decode.mask, BlockDiagonalCausalWithOffsetPaddedKeysMask)
    assert decode.mask.k_seqinfo.seqlen_py == [4, 4, 3]
    assert decode.cache_positions.tolist() == [9 % 4, 2 * 4 + 2]


def test_interleave_kv_puts_each_cache_before_its_chunk():
    cache = position_cache(window=4, batch=3)
    write_chunk(cache, [6, 2, 0])
    metadata = cache.get_input_metadata([2, 1, 3])
    keys = metadata[0].positions.float()[:, None, None]
    key, _ = cache.get_view(0, metadata).interleave_kv(keys, keys)
    assert key[:, 0, 0].long().tolist() == [2, 3, 4, 5, 6, 7] + [0, 1, 2] + [0, 1, 2]


def test_kv_gather_worked_example():
    """S = 3, chunk_lengths [2, 0, 1], seen [4, 9, 1] (the example in kv_gather's docstring)."""
    gather = kv_gather([2, 0, 1], [4, 9, 1], cache_size=3, device=torch.device("cpu"))
    assert gather.cache_rows.tolist() == [1, 2, 0, 6]
    assert gather.cache_dst.tolist() == [0, 1, 2, 5]
    assert gather.chunk_dst.tolist() == [3, 4, 6]
    assert gather.total == 7


@pytest.mark.parametrize(
    "first, second", [([6, 2, 0], [2, 1, 3]), ([9, 1, 3], [5, 0, 4]), ([1, 1, 1], [4, 4, 4]), ([3, 12, 4], [1, 7, 2])]
)
def test_gathered_kv_equals_the_unrotated_interleave(first, second):
    """The index path used on CUDA builds exactly the tensor unrotate + interleave_list build."""
    cache = position_cache(window=4, batch=3)
    write_chunk(cache, first)
    metadata = cache.get_input_metadata(second)
    view = cache.get_view(0, metadata)
    chunk = 100 + metadata[0].positions.float()[:, None, None]
    key, value = view.interleave_kv(chunk, chunk)
    assert torch.equal(gather_kv(view, chunk), key)
    assert torch.equal(gather_kv(view, chunk, values=True), value)


def test_interleave_list():
    assert interleave_list([1, 2, 3], ["a", "b", "c"]) == [1, "a", 2, "b", 3, "c"]
    with pytest.raises(ValueError):
        interleave_list([1], [])


@pytest.mark.parametrize("seen, expected", [(2, [0, 1]), (4, [0, 1, 2, 3]), (5, [1, 2, 3, 0]), (7, [3, 0, 1, 2])])
def test_unrotate_returns_slots_oldest_first(seen, expected):
    buffer = torch.arange(4)
    assert unrotate(buffer, seen).tolist() == expected


def test_cache_without_window_is_sized_by_the_caller_and_never_wraps():
    from conftest import random_model, tiny_args

    model = random_model(tiny_args(sliding_window=None))
    cache = model.make_cache(2, max_seqlen=30)
    assert cache.cache_size == 30
    assert cache.cache_k.shape == (2, 2, 30, 2, 16)
    windowed = random_model(tiny_args(sliding_window=8)).make_cache(2, max_seqlen=1000)
    assert windowed.cache_size == 8


def test_interleave_kv_of_many_sequences_gathers_the_same_keys():
    """Beyond LOOP_MAX_SEQUENCES sequences the fast modules gather by index on CPU too (a serving
    step: most sequences bring one token): each cache in position order, then its chunk."""
    batch, window = LOOP_MAX_SEQUENCES + 3, 4
    cache = position_cache(window=window, batch=batch)
    first = [1 + (3 * b) % 9 for b in range(batch)]  # 1..9 tokens already seen
    write_chunk(cache, first)
    second = [1] * (batch - 2) + [3, 0]  # the last sequence sits this step out
    metadata = cache.get_input_metadata(second)
    chunk = metadata[0].positions.float()[:, None, None]
    key, value = gathered_kv(cache.get_view(0, metadata), chunk, chunk)
    expected = [p for seen, n in zip(first, second) if n for p in range(max(0, seen - window), seen + n)]
    assert key[:, 0, 0].long().tolist() == expected
    assert torch.equal(key, value)


def test_split_mixed_docstring_example():
    cpu = torch.device("cpu")
    assert split_mixed([1, 0, 5, 1], cpu) == ([1, 0, 0, 1], [0, 0, 5, 0])
    assert split_mixed([1, 1], cpu) is None and split_mixed([4, 2], cpu) is None
    assert split_mixed([1, 0, 5, 1], torch.device("cuda")) is None  # one part: the ragged kernels take it whole


def test_a_mixed_pass_has_a_decoding_part_and_a_prompt_part():
    """Sequences 0 and 3 decode, 2 reads a 3-token prompt, 1 sits out: flat rows [0 | 1 2 3 | 4]."""
    metadata = build_input_metadata([1, 0, 3, 1], [9, 5, 0, 2], cache_size=4, sliding_window=4, device=torch.device("cpu"))
    (decode_rows, decode), (prompt_rows, prompt) = metadata.parts
    assert decode_rows.tolist() == [0, 4] and decode.decoding and decode.chunk_lengths == [1, 0, 0, 1]
    kv_lengths = decode.mask.k_seqinfo.seqlen_py
    assert (kv_lengths[0], kv_lengths[3]) == (4, 3)  # each over its own buffer
    assert prompt_rows.tolist() == [1, 2, 3] and not prompt.decoding and prompt.chunk_lengths == [0, 0, 3, 0]
    assert prompt.parts is None and metadata.mask is None
    assert metadata.positions.tolist() == [9, 0, 1, 2, 2]


def test_layer_buffers_are_the_caches_own_layers_kept_as_objects():
    """``layer_keys`` / ``layer_values``: one view a layer of ``cache_k`` / ``cache_v`` (a write through
    one is the cache's), the same objects at every call (a CUDA graph marks them static), made anew
    when the buffers are replaced."""
    cache = RotatingBufferCache(3, 2, 4, 1, 2)
    keys, values = cache.layer_keys, cache.layer_values
    assert len(keys) == len(values) == 3 and keys[1].shape == (2, 4, 1, 2)
    keys[1][0, 2] = 7.0
    values[2][1, 3] = -1.0
    assert cache.cache_k[1, 0, 2].tolist() == [[7.0, 7.0]] and cache.cache_v[2, 1, 3].tolist() == [[-1.0, -1.0]]
    assert cache.cache_k.sum() == 14 and cache.cache_v.sum() == -2
    assert all(a is b for a, b in zip(keys, cache.layer_keys))
    assert all(a is b for a, b in zip(values, cache.layer_values))
    cache.cache_k = torch.ones_like(cache.cache_k)
    assert cache.layer_keys[0] is not keys[0] and cache.layer_keys[0].sum() == 16
