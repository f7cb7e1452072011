"""``SamplingParams``: one object from the front doors (LLM, the command line, the server) to the
steps; its check, and the per-row tensors it gives."""

from __future__ import annotations

import math

import numpy
import pytest
import torch
from conftest import random_model, tiny_args

from mixtral_infer import GenerationError, SamplingParams, Tokenizer, generate
from mixtral_infer.generation.sampling_params import rows_sampling
from mixtral_infer.sampling import Sampling
from mixtral_infer.serve.engine import RequestSettings
from mixtral_infer.serve.protocol import parse_completion


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_args(max_batch_size=2), seed=7)


def same(a: Sampling, b: Sampling) -> bool:
    tensors = all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("temperature", "top_p", "top_k"))
    return tensors and (a.greedy, a.filtered) == (b.greedy, b.filtered)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(max_tokens=-1), "max_tokens=-1 must be an integer >= 0"),
        (dict(temperature="hot"), "temperature='hot' must be a number >= 0 (0 means greedy)"),
        (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
        (dict(top_k=0), "top_k=0 must be an integer >= 1 (or None for no limit)"),
        (dict(seed=-1), "seed=-1 must be an integer in [0, 2**63) (or None for a random one)"),
        (dict(seed=[1, -1]), "seed[1]=-1 must be an integer in [0, 2**63)"),
        (dict(n=0), "n=0 must be an integer >= 1 (answers per prompt)"),
        (dict(stop="x"), "stop='x' must be a list of non-empty strings"),
        (dict(regex="a", choices=["a"]), "give one of regex, choices"),
        (dict(presence_penalty=3), "presence_penalty=3 must be a number in [-2, 2]"),
        (dict(min_tokens=50, max_tokens=5), "min_tokens=50 must be an integer in [0, max_tokens=5]"),
        (dict(logit_bias={-1: 1.0}), "logit_bias {-1: 1.0}: keys must be token ids in the vocabulary, values numbers"),
    ],
)
def test_check_says_the_field_in_one_line(fields, message):
    with pytest.raises(GenerationError) as error:
        SamplingParams(**fields).check()
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_check_takes_integers_of_any_kind_and_gives_python_ints():
    checked = SamplingParams(max_tokens=numpy.int64(4), top_k=torch.tensor(5), seed=numpy.uint8(3)).check()
    assert (checked.max_tokens, checked.top_k, checked.seed) == (4, 5, 3)
    assert all(type(v) is int for v in (checked.max_tokens, checked.top_k, checked.seed))
    with pytest.raises(GenerationError, match=r"a list of one per prompt \(3\)"):
        SamplingParams(seed=[1, 2]).check(batch=3)
    with pytest.raises(GenerationError, match=r"keys must be token ids in \[0, 100\)"):
        SamplingParams(logit_bias={100: 1.0}).check(vocab_size=100)


def test_to_sampling_gives_the_steps_per_row_tensors():
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
                   SamplingParams(temperature=1e-40), SamplingParams(temperature=1e39, top_k=1000)):  # fmt: skip
        expected = Sampling.uniform_settings(3, 100, params.effective_temperature, params.top_p, params.top_k)
        assert same(params.to_sampling(3, 100), expected)
    assert SamplingParams(temperature=1e-40).to_sampling(2, 100).greedy  # below GREEDY_BELOW: the greedy limit
    assert math.isinf(SamplingParams(temperature=1e39).effective_temperature)  # past float32: uniform
    rows = [SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=0.9, top_p=0.5)]
    assert [p.filtered(100) for p in rows] == [True, True] and not SamplingParams(top_k=100).filtered(100)
    stacked = rows_sampling(rows, 100, "cpu", filtered=True)
    assert stacked.top_k.tolist() == [3, 100] and stacked.top_p.tolist() == [1.0, 0.5]


def test_generate_takes_the_object_or_its_fields(model):
    prompts = [[1, 5, 6], [1, 7]]
    params = SamplingParams(max_tokens=5, temperature=0.8, top_k=5, seed=[3, 4], presence_penalty=[0.5, 0.0])
    by_fields = generate(prompts, model, max_tokens=5, temperature=0.8, top_k=5, seed=[3, 4], presence_penalty=[0.5, 0.0])
    assert generate(prompts, model, params) == by_fields
    assert generate(prompts, model, params, temperature=0) == generate(prompts, model, max_tokens=5, seed=[3, 4],
                                                                        top_k=5, presence_penalty=[0.5, 0.0])  # fmt: skip
    assert generate(prompts, model, max_tokens=3) == generate(prompts, model, SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(TypeError, match="needs max_tokens"):
        generate(prompts, model)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['top_kk'\]"):
        generate(prompts, model, max_tokens=3, top_kk=3)
    with pytest.raises(GenerationError, match="n=2: generate gives one answer per prompt"):
        generate(prompts, model, SamplingParams(max_tokens=3, n=2))


def test_the_server_s_request_settings_are_the_object():
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    parsed = parse_completion({"prompt": "x", "max_tokens": 3, "temperature": 0.5, "top_k": 7, "seed": 2}, tokenizer, "m")
    settings = parsed.settings
    assert isinstance(settings, RequestSettings) and isinstance(settings, SamplingParams)
    assert (settings.max_tokens, settings.temperature, settings.top_k, settings.seed) == (3, 0.5, 7, 2)
    assert settings.check() == settings  # what the server accepts, the object's check accepts
    assert RequestSettings(max_tokens=4).temperature == 0.0  # the engine's default: greedy


def test_a_conversation_takes_the_object_or_its_fields():
    from mixtral_infer import Conversation, load_model

    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    by_fields = Conversation(model, tokenizer, max_tokens=6, temperature=0.9, top_k=20, seed=5)
    by_object = Conversation(model, tokenizer, SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=5))
    assert by_fields.reply("And God said").text == by_object.reply("And God said").text
    assert Conversation(model, tokenizer).params == SamplingParams(max_tokens=100, temperature=0.0)  # its defaults
    with pytest.raises(GenerationError, match=r"seed=\[1\] must be an integer"):
        Conversation(model, tokenizer, seed=[1])  # one seed: turn t samples with seed + t
