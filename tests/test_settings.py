"""Odd settings and cache misuse in the API: one GenerationError line before any work, or the limit's behaviour."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy
import pytest
import torch
from conftest import WINDOW, random_model, tiny_args

from mixtral_infer import GenerationError, generate
from mixtral_infer.errors import as_int
from mixtral_infer.generation.sampling_params import GREEDY_BELOW
from mixtral_infer.generation.settings import kv_cache_bytes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_args(max_batch_size=2), seed=7)


@pytest.fixture(scope="module")
def no_window():
    return random_model(tiny_args(sliding_window=None, max_batch_size=2), seed=7)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(seed="abc"), r"seed='abc' must be an integer in \[0, 2\*\*63\)"),
        (dict(seed=1.5), r"seed=1.5 must be an integer"),
        (dict(seed=2**64 + 1), r"seed=18446744073709551617 must be an integer"),
        (dict(seed=-1), r"seed=-1 must be an integer"),
        (dict(max_tokens="abc"), "max_tokens='abc' must be an integer >= 0"),
        (dict(max_tokens=2.0), "max_tokens=2.0 must be an integer >= 0"),
        (dict(temperature="hot"), "temperature='hot' must be a number >= 0"),
        (dict(temperature=float("nan")), "temperature=nan must be >= 0"),
        (dict(top_k=True), "top_k=True must be an integer >= 1"),
        (dict(chunk_size=1.5), "chunk_size=1.5 must be an integer >= 1"),
    ],
)
def test_wrong_types_are_one_line(model, settings, message):
    with pytest.raises(GenerationError, match=message):
        generate([[1, 5, 6]], model, **{"max_tokens": 4, **settings})


def test_integer_like_token_ids_and_settings_are_accepted(model):
    expected = generate([[1, 5, 6]], model, max_tokens=4, temperature=0.8, seed=3, top_k=5)
    prompt = [numpy.int64(1), torch.tensor(5), numpy.int32(6)]
    got = generate([prompt], model, max_tokens=numpy.int64(4), temperature=0.8, seed=numpy.uint8(3), top_k=torch.tensor(5))
    assert got == expected
    assert generate([torch.tensor([1, 5, 6])], model, max_tokens=4, temperature=0.8, seed=3, top_k=5) == expected


@pytest.mark.parametrize(
    "token, message",
    [
        (1.0, "token id 1.0 of type float: token ids must be integers"),
        (torch.tensor(1.0), "of type Tensor: token ids must be integers"),
        ("5", "token id '5' of type str"),
        (True, "token id True of type bool"),
        (numpy.int64(128), r"token id 128 outside the vocabulary \[0, 128\)"),
    ],
)
def test_token_ids_that_are_not_integers_say_so(model, token, message):
    with pytest.raises(GenerationError, match=message):
        generate([[1, 2], [1, token]], model, max_tokens=2)


def test_integer_like_helper():
    assert [as_int(v) for v in (numpy.int16(3), torch.tensor(4), 5, 5.0, "5", torch.tensor(True), torch.tensor([1]))] == [
        3, 4, 5, None, None, None, None,
    ]


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, GREEDY_BELOW / 2])
def test_tiny_temperatures_behave_as_greedy(model, temperature):
    prompts = [[1, 5, 6], [1, 9]]
    greedy = generate(prompts, model, max_tokens=12)
    assert generate(prompts, model, max_tokens=12, temperature=temperature, seed=0) == greedy


# ------------------------------------------------------------------ the cache


def test_a_cache_too_small_for_a_model_without_a_window_is_refused(no_window):
    cache = no_window.make_cache(1, max_seqlen=10)
    with pytest.raises(GenerationError, match=r"the cache holds 10 slots per sequence, but sequence 0 needs 13 \(0 already seen \+ 3 prompt tokens \+ max_tokens=10\): make it with model.make_cache\(batch, max_seqlen=13\)"):
        generate([[1, 5, 6]], no_window, max_tokens=10, cache=cache)
    generated, _ = generate([[1, 5, 6]], no_window, max_tokens=7, cache=cache)  # exactly fits
    assert len(generated[0]) == 7


def test_a_cache_below_the_window_is_refused_once_the_sequence_outgrows_it(model):
    cache = model.make_cache(1, max_seqlen=WINDOW // 2)
    with pytest.raises(GenerationError, match=f"the cache holds {WINDOW // 2} slots per sequence, but sequence 0 needs {WINDOW}"):
        generate([[1, 5, 6]], model, max_tokens=2 * WINDOW, cache=cache)


def test_a_continued_conversation_counts_what_the_cache_has_seen(no_window):
    cache = no_window.make_cache(1, max_seqlen=12)
    generate([[1, 5, 6]], no_window, max_tokens=4, cache=cache)  # 3 + 3 fed (the last token is sampled, not fed)
    assert cache.tokens_seen == [6]
    with pytest.raises(GenerationError, match=r"needs 13 \(6 already seen \+ 2 prompt tokens \+ max_tokens=5\)"):
        generate([[7, 8]], no_window, max_tokens=5, cache=cache)


def test_a_cache_of_another_model_is_refused(model, no_window):
    with pytest.raises(GenerationError, match="the cache was made for sliding_window=None, the model has sliding_window=8"):
        generate([[1, 5, 6]], model, max_tokens=2, cache=no_window.make_cache(1, max_seqlen=50))
    with pytest.raises(GenerationError, match=r"the cache \(layers, KV heads, head dim = \(2, 2, 16\), torch.float16, cpu\) does not fit"):
        generate([[1, 5, 6]], model, max_tokens=2, cache=random_model(tiny_args(), seed=1).half().make_cache(1))


def test_kv_cache_bytes():
    args = tiny_args(sliding_window=None)
    from mixtral_infer.model.parallel import Parallel

    # 2 (K and V) x 2 layers x 3 sequences x 100 slots x 2 KV heads x 16 x 4 bytes
    assert kv_cache_bytes(args, 3, 100, torch.float32, Parallel()) == 2 * 2 * 3 * 100 * 2 * 16 * 4
    assert kv_cache_bytes(tiny_args(), 3, 100, torch.float32, Parallel()) == 2 * 2 * 3 * WINDOW * 2 * 16 * 4


HUGE_CACHE_SCRIPT = textwrap.dedent(
    """
    import resource, sys
    sys.path.insert(0, "tests")
    from conftest import random_model, tiny_args
    from mixtral_infer import GenerationError, generate
    model = random_model(tiny_args(sliding_window=None), seed=0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        generate([[1, 2, 3]], model, max_tokens=10**9)
        print("generated")
    except GenerationError as error:
        print(error)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
    """
)


def test_max_tokens_beyond_memory_without_a_window_is_refused_before_allocating():
    result = subprocess.run([sys.executable, "-c", HUGE_CACHE_SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    message, peak_mb = result.stdout.strip().splitlines()
    # 2 x 2 layers x 1 sequence x (10**9 + 3) slots x 2 KV heads x 16 x 4 bytes
    assert message.startswith(
        "max_tokens=1000000000: the KV cache for 1 sequence(s) of up to 1000000003 tokens (no sliding window) needs 512.0 GB, more than the"
    ), message
    assert message.endswith("lower max_tokens or the batch")
    assert int(peak_mb) < 50


@pytest.mark.parametrize(
    "module",
    ["errors", "checkpoint.safetensors_reader", "checkpoint.weight_shapes", "checkpoint.hf_format", "devices"],
)
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"mixtral_infer.{module}"))
    assert result.attempted > 0 and result.failed == 0
