"""The tokenizer.json back-end (tokenizer/json_tokenizer.py) on the hub's layout of a tekken model
(transformers' conversion of Mistral's tekken file), and ``convert`` writing each layout's tokenizer
files for a tekken source (checkpoint/hf_tokenizer.py: ``write_hf_tekken_tokenizer``)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from mixtral_infer import CheckpointError, Tokenizer, load_model
from mixtral_infer.checkpoint.convert import convert
from mixtral_infer.checkpoint.hf_tokenizer import tekken_tokenizer_json
from mixtral_infer.checkpoint.loading import save_consolidated
from mixtral_infer.generation.text_stream import TextStream
from mixtral_infer.structured.grammar import ll_tokenizer
from mixtral_infer.tokenizer.json_tokenizer import JsonTokenizer, byte_level_alphabet

from conftest import random_model, tiny_args
from test_tokenizer_tekken import TEKKEN, TEXTS, small_tekken

SPECIAL_STRINGS = ("[INST]", "[/INST]", "<s>", "</s>", "[TOOL_CALLS]", "<unk>")


def transformers_tokenizer(folder):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory) -> Path:
    """The hub's layout of a tekken model's tokenizer, by transformers' own conversion: tokenizer.json,
    tokenizer_config.json (bos_token <s>, eos_token </s>), no tekken.json."""
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    folder = tmp_path_factory.mktemp("hub")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_tekken_tokenizer(str(TEKKEN)).save_pretrained(folder)
    assert not (folder / "tekken.json").exists()
    return folder


@pytest.fixture(scope="module")
def ours(hub_folder) -> Tokenizer:
    return Tokenizer.from_folder(hub_folder)


@pytest.fixture(scope="module")
def tekken() -> Tokenizer:
    return Tokenizer(TEKKEN)


def test_a_folder_with_only_tokenizer_json_loads(ours, hub_folder):
    assert isinstance(ours, JsonTokenizer) and ours.kind == "tokenizer.json" and ours.path == hub_folder / "tokenizer.json"
    assert (ours.n_words, ours.bos_id, ours.eos_id, ours.version, ours.chat_format) == (131072, 1, 2, "v3", "v3")
    assert ours.control_ids("[INST]", "[/INST]") == [3, 4] and ours.control_ids("[INST]", "nope") is None
    assert [ours.is_control(i) for i in (0, 1, 999, 1000, 131071)] == [True, True, True, False, False]


def test_encode_and_decode_equal_the_tekken_tokenizer(ours, tekken):
    for text in TEXTS:
        ids = ours.encode(text, bos=True, eos=True)
        assert ids == tekken.encode(text, bos=True, eos=True), text
        assert ours.decode(ids) == tekken.decode(ids) == text, text
    assert ours.encode("[INST] hi </s>", bos=False) == tekken.encode("[INST] hi </s>", bos=False)  # text, not controls
    assert not any(ours.is_control(i) for i in ours.encode(" ".join(SPECIAL_STRINGS), bos=False))


def test_encode_and_decode_equal_transformers_for_the_same_folder(ours, hub_folder):
    theirs = transformers_tokenizer(hub_folder)
    for text in TEXTS:
        if any(special in text for special in SPECIAL_STRINGS):
            continue  # transformers splits special tokens' strings out of text: [INST] becomes id 3 there
        ids = ours.encode(text, bos=False)
        assert theirs.encode(text, add_special_tokens=False) == ids, text
        assert theirs.decode([1, *ids, 2], skip_special_tokens=True) == ours.decode([1, *ids, 2]), text
    assert theirs.encode("[INST]", add_special_tokens=False) == [3] and 3 not in ours.encode("[INST]")


def test_each_token_writes_the_tekken_token_s_bytes(ours, tekken):
    assert all(ours.token_bytes(i) == tekken.token_bytes(i) for i in range(ours.n_words))
    for token in (0, 3, 1000, 1032, 1255, 57506, 119685):
        assert ours.id_to_piece(token) == tekken.id_to_piece(token), token
        assert ours.byte_value(token) == tekken.byte_value(token), token
    assert byte_level_alphabet()[0x20] == "\u0120" and byte_level_alphabet()[0x0A] == "\u010a"  # Ġ and Ċ


def test_decode_continuation_streaming_and_the_grammar_bridge(ours):
    assert ours.decode_continuation(ours.encode(" unto", bos=False)) == " unto"
    text = " Praise 😀👍🏽 你好世界"
    stream = TextStream(ours, leading_space=True)
    pieces = [stream.push(token) for token in ours.encode(text, bos=False)] + [stream.finish()]
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces)
    ll = ll_tokenizer(ours)
    assert ll.decode_bytes(ours.encode(text, bos=False)) == text.encode()
    assert ll.is_special_token(ours.eos_id) and not ll.is_special_token(57506)


def test_bos_and_eos_come_from_the_configuration_files(hub_folder, tmp_path):
    folder = tmp_path / "hub"
    shutil.copytree(hub_folder, folder)
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "[/INST]"}}))
    assert Tokenizer.from_folder(folder).eos_id == 4  # special_tokens_map.json before tokenizer_config.json
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(CheckpointError, match=r"special_tokens_map\.json: eos_token '<\|nope\|>' is not a token of tokenizer\.json"):
        Tokenizer.from_folder(folder)
    (folder / "special_tokens_map.json").unlink()
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a tokenizer\.json the tokenizers library reads \("):
        Tokenizer.from_folder(folder)


def test_our_tekken_conversion_encodes_as_transformers_and_mistral_common(tekken, hub_folder, tmp_path):
    from tokenizers import Tokenizer as HfTokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tekken_tokenizer_json(tekken.file)), encoding="utf-8")
    written = HfTokenizer.from_file(str(path))
    written.encode_special_tokens = True  # as JsonTokenizer reads it: "[INST]" is text
    theirs = HfTokenizer.from_file(str(hub_folder / "tokenizer.json"))
    for text in TEXTS:
        ids = tekken.encode(text, bos=False)
        assert written.encode(text).ids == [1, *ids], text  # <s> prepended
        if not any(special in text for special in SPECIAL_STRINGS):
            assert theirs.encode(text, add_special_tokens=False).ids == ids, text
        assert written.decode(ids) == text


@pytest.fixture()
def tekken_model(tmp_path) -> Path:
    """A Mistral folder of a tiny model (vocabulary 3000) with a small tekken file."""
    folder = tmp_path / "mistral"
    save_consolidated(random_model(dataclasses.replace(tiny_args(moe=False), vocab_size=3000), seed=2), folder)
    small_tekken(folder)
    return folder


def test_convert_writes_the_tokenizer_each_layout_expects(tekken_model, tmp_path):
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    source = Tokenizer.from_folder(tekken_model)
    convert(tekken_model, tmp_path / "hf", to="hf")
    hf = tmp_path / "hf"
    assert {"tekken.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in hf.iterdir()}
    written = Tokenizer(hf / "tokenizer.json")
    theirs = transformers_tokenizer(hf)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]  # fmt: skip
    expected = source.mistral_common().encode_chat_completion(ChatCompletionRequest.from_openai(messages)).tokens
    assert list(theirs.apply_chat_template(messages, tokenize=True, return_dict=False)) == expected
    for text in TEXTS:
        assert written.encode(text) == source.encode(text), text
        if not any(special in text for special in SPECIAL_STRINGS):
            assert theirs.encode(text) == source.encode(text), text  # transformers adds <s> as we do
    convert(hf, tmp_path / "back", to="mistral")
    assert (tmp_path / "back" / "tekken.json").read_bytes() == (tekken_model / "tekken.json").read_bytes()
    assert Tokenizer.from_folder(tmp_path / "back").kind == "tekken"


def test_a_hub_folder_with_only_tokenizer_json_converts_and_loads(tekken_model, tmp_path):
    hf = tmp_path / "hf"
    convert(tekken_model, hf, to="hf")
    (hf / "tekken.json").unlink()  # the hub's layout: tokenizer.json alone
    model = load_model(hf, device="cpu", dtype=torch.float32)
    assert Tokenizer.from_folder(hf).kind == "tokenizer.json" and model.args.vocab_size == 3000
    convert(hf, tmp_path / "back", to="mistral")
    names = {p.name for p in (tmp_path / "back").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names and "tekken.json" not in names
    assert Tokenizer.from_folder(tmp_path / "back").encode("unto them") == Tokenizer(tekken_model / "tekken.json").encode("unto them")
