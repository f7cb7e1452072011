"""Every bad model, bad input and bad setting gets one clear error, before any heavy work."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from command_line import in_process
from conftest import WINDOW, random_model, tiny_args

from mixtral_infer import (
    CheckpointError,
    ConfigError,
    GenerationError,
    Tokenizer,
    generate,
    load_model,
)
from mixtral_infer.checkpoint.safetensors_reader import iter_tensors
from mixtral_infer.checkpoint.safetensors_writer import write_safetensors


def load(folder):
    return load_model(folder, device="cpu", dtype=torch.float32)


def edit_params(folder, **changes):
    path = folder / "params.json"
    params = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            params.pop(key, None)
        else:
            params[key] = value
    path.write_text(json.dumps(params))


def rewrite_weights(folder, transform):
    path = folder / "consolidated.safetensors"
    tensors = dict(iter_tensors(path))
    write_safetensors(path, transform(tensors).items())


# ------------------------------------------------------------------ model folders


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="model folder not found"):
        load(tmp_path / "nope")


def test_a_file_is_not_a_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a folder"):
        load(tmp_path / "file")


def test_folder_without_params_or_config(tmp_path):
    with pytest.raises(CheckpointError, match="neither params.json .* nor config.json"):
        load(tmp_path)


def test_folder_without_weights(model_folder):
    (model_folder / "consolidated.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        load(model_folder)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "params.json: not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_params_not_json(model_folder, content, message):
    (model_folder / "params.json").write_text(content)
    with pytest.raises(ConfigError, match=message):
        load(model_folder)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(dim=None), r"missing required field\(s\) \['dim'\]"),
        (dict(dim="64"), "dim='64' must be a positive integer"),
        (dict(n_layers=0), "n_layers=0 must be a positive integer"),
        (dict(n_kv_heads=3), "n_heads=4 is not a multiple of n_kv_heads=3"),
        (dict(sliding_window=0), "sliding_window=0 must be a positive integer or null"),
        (dict(sliding_window=-4), "sliding_window=-4"),
        (dict(moe={"num_experts": 4, "num_experts_per_tok": 5}), "num_experts_per_tok=5 exceeds moe.num_experts=4"),
        (dict(moe={"num_experts": 4}), "moe must be"),
        (dict(norm_eps="small"), "norm_eps='small' must be a positive number"),
    ],
)
def test_bad_params(model_folder, changes, message):
    edit_params(model_folder, **changes)
    with pytest.raises(ConfigError, match=message):
        load(model_folder)


def test_unknown_params_keys_are_ignored_with_a_warning(model_folder):
    edit_params(model_folder, model_type="mixtral", use_biases=False)
    with pytest.warns(UserWarning, match=r"ignoring unknown keys \['model_type', 'use_biases'\]"):
        model = load(model_folder)
    assert model.args.dim == 64


def test_head_dim_that_the_weights_disagree_with_names_tensor_and_both_shapes(model_folder):
    edit_params(model_folder, head_dim=32)
    with pytest.raises(CheckpointError, match=r"tensor layers\.0\.attention\.w[kqv]\.weight has shape \(\d+, 64\), the model config implies \(\d+, 64\)"):
        load(model_folder)


def test_truncated_weights(model_folder):
    path = model_folder / "consolidated.safetensors"
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="truncated"):
        load(model_folder)


def test_corrupt_weights_header(model_folder):
    path = model_folder / "consolidated.safetensors"
    data = bytearray(path.read_bytes())
    data[8:16] = b"garbage!"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load(model_folder)


def test_missing_tensor(model_folder):
    rewrite_weights(model_folder, lambda t: {k: v for k, v in t.items() if k != "layers.1.ffn_norm.weight"})
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['layers.1.ffn_norm.weight'\]"):
        load(model_folder)


def test_missing_expert(model_folder):
    rewrite_weights(model_folder, lambda t: {k: v for k, v in t.items() if k != "layers.0.feed_forward.experts.2.w3.weight"})
    # It was "experts.[2].w3", no folder named.
    with pytest.raises(CheckpointError, match=re.escape(f"{model_folder}: missing tensor(s) ['layers.0.feed_forward.experts.2.w3.weight']")):
        load(model_folder)


def test_unexpected_tensor(model_folder):
    rewrite_weights(model_folder, lambda t: {**t, "layers.0.attention.bias": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor layers\.0\.attention\.bias"):
        load(model_folder)


def test_tensor_of_wrong_shape(model_folder):
    rewrite_weights(model_folder, lambda t: {**t, "norm.weight": torch.ones(65)})
    with pytest.raises(CheckpointError, match=r"tensor norm\.weight has shape \(65,\), the model config implies \(64,\)"):
        load(model_folder)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_or_infinite_weights_are_named_when_loaded(model_folder, bad, dtype):
    """In bfloat16 a NaN key would not even reach the logits' check: CPU attention drops its scores."""

    def damaged(tensors):
        tensors["layers.1.attention.wk.weight"][3, 5] = bad
        return tensors

    rewrite_weights(model_folder, damaged)
    message = r"layers\.1\.attention\.wk\.weight holds NaN or infinite values: the checkpoint is damaged"
    with pytest.raises(CheckpointError, match=message):
        load_model(model_folder, dtype=dtype)


def test_weights_beyond_float16_s_range_name_the_dtypes_that_hold_them(model_folder):
    rewrite_weights(model_folder, lambda t: {**t, "norm.weight": torch.full((64,), 1e5)})
    with pytest.raises(CheckpointError, match=r"norm\.weight holds values beyond torch.float16's range: load in"):
        load_model(model_folder, dtype=torch.float16)
    norm = load_model(model_folder, dtype=torch.bfloat16).norm.weight
    assert norm.float().max().item() == pytest.approx(1e5, rel=2**-8)


def test_tokenizer_vocabulary_must_match_before_weights_are_read(model_folder, monkeypatch):
    edit_params(model_folder, vocab_size=500)
    import mixtral_infer.checkpoint.loading as checkpoint

    monkeypatch.setattr(checkpoint, "iter_tensors", lambda path: pytest.fail("weights read before the check"))
    with pytest.raises(CheckpointError, match="tokenizer.model: vocabulary of 400 tokens, but the model config says vocab_size=500"):
        load(model_folder)


class RunsCode:
    """Unpickling this would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pth_that_would_run_code_is_refused(model_folder, tmp_path):
    (model_folder / "consolidated.safetensors").unlink()
    marker = tmp_path / "code-ran"
    torch.save({"tok_embeddings.weight": torch.zeros(2), "payload": RunsCode(marker)}, model_folder / "consolidated.00.pth")
    with pytest.raises(CheckpointError, match="refused"):
        load(model_folder)
    assert not marker.exists()


def test_plain_pth_checkpoint_loads(model_folder):
    tensors = dict(iter_tensors(model_folder / "consolidated.safetensors"))
    (model_folder / "consolidated.safetensors").unlink()
    torch.save(tensors, model_folder / "consolidated.00.pth")
    model = load(model_folder)
    assert torch.equal(model.norm.weight, tensors["norm.weight"])


# ------------------------------------------------------------------ generation settings


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_args(max_batch_size=2), seed=7)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(max_tokens=-1), "max_tokens=-1 must be an integer >= 0"),
        (dict(temperature=-0.5), "temperature=-0.5 must be >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
        (dict(top_k=0), "top_k=0 must be an integer >= 1"),
        (dict(chunk_size=0), "chunk_size=0 must be an integer >= 1"),
    ],
)
def test_generation_settings_out_of_range(model, settings, message):
    with pytest.raises(GenerationError, match=message):
        generate([[1, 5, 6]], model, **{"max_tokens": 4, **settings})


def test_more_prompts_than_max_batch_size(model):
    with pytest.raises(GenerationError, match="3 prompts exceed max_batch_size=2: pass fewer prompts or load the model"):
        generate([[1], [1], [1]], model, max_tokens=2)
    with pytest.raises(GenerationError, match=r"2 prompts exceed max_batch_size=1: pass fewer prompts or make the cache for more"):
        generate([[1], [1]], model, max_tokens=2, cache=model.make_cache(1))  # it said to load the model otherwise


def test_no_prompts(model):
    with pytest.raises(GenerationError, match="no prompts given"):
        generate([], model, max_tokens=2)


@pytest.mark.parametrize("token", [-1, 128, 10**9])
def test_token_ids_outside_the_vocabulary(model, token):
    with pytest.raises(GenerationError, match=rf"prompt 1 has token id {token} outside the vocabulary \[0, 128\)"):
        generate([[1, 2], [1, token]], model, max_tokens=2)


@pytest.mark.parametrize(
    "prompts, message",
    [
        ("In the beginning", "encoded_prompts='In the beginning': pass a list of prompts, each a list of token ids"),
        (None, "encoded_prompts=None: pass a list of prompts"),  # was: a str read as one prompt per letter, None a TypeError
        ({(1, 5)}, r"encoded_prompts=\{\(1, 5\)\}: pass a list of prompts"),  # a set (no order) was a TypeError
        (["In the beginning"], r"prompt 0 is text \('In the beginning'\): encode it first"),
    ],
)
def test_text_where_token_ids_belong_is_named(model, prompts, message):
    with pytest.raises(GenerationError, match=message):
        generate(prompts, model, max_tokens=2)


@pytest.mark.parametrize(
    "prompts, message",
    [
        # One prompt's ids where a list of prompts belongs: each id was read as a prompt, and len(5)
        # raised TypeError (or, with more ids than rows, "5 prompts exceed max_batch_size").
        ([1, 5, 6], r"encoded_prompts=\[1, 5, 6\] holds token ids, not prompts: pass a list of prompts, \[ids\]"),
        (torch.tensor([1, 5, 6]), r"encoded_prompts=tensor\(\[1, 5, 6\]\) holds token ids, not prompts"),
        ([[1, 5], None], "prompt 1 is None, not a list of token ids"),
    ],
)
def test_one_prompt_given_as_the_list_of_prompts_is_named(model, prompts, message):
    with pytest.raises(GenerationError, match=message):
        generate(prompts, model, max_tokens=2)


def test_prompts_and_settings_of_numpy_and_torch_types_are_taken(model):
    """A (B, T) tensor or array of prompts, numpy numbers as settings: the same tokens as plain Python."""
    expected = generate([[1, 5, 6]], model, max_tokens=3, temperature=0.5, top_p=0.9, seed=3)
    for prompts in (torch.tensor([[1, 5, 6]]), np.array([[1, 5, 6]]), [np.array([1, 5, 6])]):
        settings = dict(temperature=np.float32(0.5), top_p=np.float32(0.9), seed=np.int64(3), max_tokens=np.int64(3))
        assert generate(prompts, model, **settings) == expected  # np.float32 was "temperature must be >= 0"


@pytest.mark.parametrize("args, message", [((-1,), "batch_size=-1): must be an integer >= 1"),
                                           ((2.0,), "batch_size=2.0): must be an integer >= 1"),
                                           ((2, -5), "max_seqlen=-5): must be an integer >= 0")])  # fmt: skip
def test_a_cache_of_no_rows_or_slots_is_refused(model, args, message):
    with pytest.raises(GenerationError, match=re.escape(message)):
        model.make_cache(*args)  # -1 was zeros()' RuntimeError


@pytest.mark.parametrize("option, message", [(dict(parallel=5), "parallel=5 must be a Parallel"),
                                             (dict(progress=5), "progress=5 must be a function progress"),
                                             (dict(pack=1), "pack=1: use True")])  # fmt: skip
def test_load_model_names_an_option_of_the_wrong_kind(model_folder, option, message):
    with pytest.raises(ConfigError, match=re.escape(message)):  # were an AttributeError and a TypeError mid-read
        load_model(model_folder, **option)


@pytest.mark.parametrize("cache", [5, {}])
def test_a_cache_that_is_not_one_is_refused(model, cache):
    with pytest.raises(GenerationError, match=rf"cache={cache!r} must be a cache from model.make_cache\(batch\), or None"):
        generate([[1, 5, 6]], model, max_tokens=2, cache=cache)  # was an AttributeError


@pytest.mark.parametrize("name, value", [("temperature", "inf"), ("temperature", torch.tensor(0.5)), ("top_p", "0.5")])
def test_settings_that_are_not_numbers_are_called_so(model, name, value):
    """A command line's --temperature inf arrives as the text 'inf': it was "must be >= 0"."""
    with pytest.raises(GenerationError, match=re.escape(f"{name}={value!r} must be a number")):
        generate([[1, 5, 6]], model, max_tokens=2, **{name: value})


def test_an_on_token_that_cannot_be_called_is_refused_before_the_prompt_runs(model):
    with pytest.raises(GenerationError, match="on_token=5 must be a function on_token"):
        generate([[1, 5, 6]], model, max_tokens=2, on_token=5)  # was a TypeError after the prefill


@pytest.mark.parametrize("eos_id", [-1, 128, "2", 2.0])
def test_an_eos_id_that_no_token_can_equal_is_refused(model, eos_id):
    """It would never end a sequence: every answer would run to max_tokens, silently."""
    with pytest.raises(GenerationError, match=rf"eos_id={eos_id!r} must be a token id in \[0, 128\), or None"):
        generate([[1, 2]], model, max_tokens=2, eos_id=eos_id)


@pytest.mark.parametrize("token", [-1, 400, 10**6])
def test_decoding_an_id_outside_the_vocabulary_names_it(tokenizer_path, token):
    """sentencepiece said only "piece id is out of range", without the id."""
    tokenizer = Tokenizer(tokenizer_path)
    with pytest.raises(GenerationError, match=rf"token id {token} is outside this tokenizer's vocabulary \[0, 400\)"):
        tokenizer.decode([5, token])
    assert tokenizer.decode([]) == ""


def test_decode_takes_a_tensor_of_ids_and_names_what_is_not_one(tokenizer_path):
    """A 1-D tensor (what a model returns) decodes as its list (it was "len() of a 0-d tensor"); one
    id alone, a float or a bool, and a piece id outside the vocabulary get one line each (they were
    TypeErrors, True read as id 1, and sentencepiece's bare "OUT_OF_RANGE")."""
    tokenizer = Tokenizer(tokenizer_path)
    ids = tokenizer.encode("In the beginning", bos=False)
    assert tokenizer.decode(torch.tensor(ids)) == tokenizer.decode(np.array(ids)) == tokenizer.decode(ids)
    assert tokenizer.decode_continuation(torch.tensor(ids)) == tokenizer.decode_continuation(ids)
    for bad, message in [(7, "decode(7): pass a list of token ids (one id: [id])"),
                         ([5, 1.5], "token id 1.5 of type float: token ids must be integers"),
                         ([True], "token id True of type bool: token ids must be integers")]:  # fmt: skip
        with pytest.raises(GenerationError, match=re.escape(message)):
            tokenizer.decode(bad)
    with pytest.raises(GenerationError, match=r"token id 400 is outside this tokenizer's vocabulary \[0, 400\)"):
        tokenizer.id_to_piece(400)


def test_empty_prompt_string_with_and_without_bos(model, tokenizer_path):
    tokenizer = Tokenizer(tokenizer_path)
    assert tokenizer.encode("", bos=True) == [tokenizer.bos_id]
    generated, logprobs = generate([tokenizer.encode("", bos=True)], model, max_tokens=5)
    assert len(generated[0]) == 5 and len(logprobs[0]) == 5
    with pytest.raises(GenerationError, match="prompt 0 is empty"):
        generate([tokenizer.encode("", bos=False)], model, max_tokens=5)


@pytest.mark.parametrize(
    "text, decoded",
    [
        ("🙂 emoji 🚀", "🙂 emoji 🚀"),
        ("中文字符和日本語", "中文字符和日本語"),
        ("mixed \u0000 nul", "mixed \u0000 nul"),
        # An undecodable input byte becomes U+FFFD, which sentencepiece's normaliser drops.
        ("lone \udcff surrogate", "lone surrogate"),
    ],
)
def test_any_unicode_encodes_and_round_trips(tokenizer_path, text, decoded):
    tokenizer = Tokenizer(tokenizer_path)
    ids = tokenizer.encode(text, bos=False)
    assert all(0 <= i < tokenizer.n_words for i in ids)
    assert tokenizer.decode(ids) == decoded


def test_prompt_much_longer_than_the_window(model):
    prompt = torch.randint(3, 128, (12 * WINDOW,), generator=torch.Generator().manual_seed(0)).tolist()
    generated, logprobs = generate([prompt], model, max_tokens=3)
    assert len(logprobs[0]) == len(prompt) - 1 + 3


# ------------------------------------------------------------------ numerical safety


@pytest.mark.parametrize("window", [WINDOW, None], ids=["window", "no-window"])
def test_unused_cache_slots_full_of_nan_change_nothing(window):
    model = random_model(tiny_args(sliding_window=window, max_batch_size=3), seed=8)
    prompts = [list(range(3, 3 + n)) for n in (2 * WINDOW + 3, 2, 5)]
    expected = generate(prompts, model, max_tokens=2 * WINDOW, chunk_size=3)
    cache = model.make_cache(3, max_seqlen=2 * WINDOW + 3 + 2 * WINDOW)
    cache.cache_k.fill_(float("nan"))
    cache.cache_v.fill_(float("nan"))
    got = generate(prompts, model, max_tokens=2 * WINDOW, chunk_size=3, cache=cache)
    assert got[0] == expected[0]
    for a, b in zip(got[1], expected[1]):
        assert a == pytest.approx(b, abs=1e-5)


def test_nan_logits_are_reported_not_sampled():
    model = random_model(tiny_args(), seed=9)
    with torch.no_grad():
        model.layers["1"].attention.wo.weight[0, 0] = float("nan")
    with pytest.raises(GenerationError, match="NaN or inf logits"):
        generate([[1, 2, 3]], model, max_tokens=3, temperature=1.0, seed=0)


# ------------------------------------------------------------------ the command line


run_cli = in_process  # main() here, as a subprocess would report it (tests/command_line.py)


@pytest.mark.parametrize(
    "args, message",
    [
        (["demo", "/no/such/folder"], "error: /no/such/folder: model folder not found"),
        (["demo", "{folder}", "--dtype", "float64"], "error: --dtype 'float64' is not one of float32, bfloat16, float16"),
        (["demo", "{folder}", "--device", "cuda:0"], "CUDA is not available" if not torch.cuda.is_available() else None),
        (["demo", "{folder}", "--temperature", "-1"], "error: --temperature -1 must be >= 0"),
        (["demo", "{folder}", "--max-tokens", "-3"], "error: --max-tokens -3 must be an integer >= 0"),
    ],
)
def test_command_line_errors_are_one_line_without_traceback(model_folder, args, message):
    if message is None:
        pytest.skip("this machine has CUDA")
    result = run_cli(*[a.format(folder=model_folder) for a in args])
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == message or message in result.stderr.strip().splitlines()[-1]


def test_command_line_names_a_missing_tokenizer(model_folder):
    (model_folder / "tokenizer.model").unlink()
    result = run_cli("demo", str(model_folder))
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: {model_folder / 'tokenizer.model'}: file not found (the command line needs the model's tokenizer)"
    (model_folder / "tokenizer.json").write_text("{}")  # a folder with transformers' fast tokenizer only: read, and refused
    result = run_cli("demo", str(model_folder))
    assert result.stderr.strip().startswith(f"error: {model_folder / 'tokenizer.json'}: not a tokenizer.json the tokenizers library reads (")


def test_interactive_unknown_command_and_end_of_input(model_folder):
    result = run_cli("interactive", str(model_folder), "--max-tokens", "3", stdin="/frobnicate\n")
    assert result.returncode == 0
    assert "unknown command /frobnicate: use /reset or /quit" in result.stderr
    assert "Traceback" not in result.stderr


def test_interactive_survives_undecodable_input_bytes(model_folder):
    result = run_cli("interactive", str(model_folder), "--max-tokens", "3", stdin=b"caf\xe9 \xff\xfe\n")
    assert result.returncode == 0
    assert "Traceback" not in result.stderr
