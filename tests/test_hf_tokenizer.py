"""Converted Hugging Face folders tokenize and generate in transformers exactly as here; v3 tokenizers."""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from command_line import in_process

from mixtral_infer import CheckpointError, Tokenizer, generate, load_model
from mixtral_infer.checkpoint.convert import convert
from mixtral_infer.checkpoint.hf_tokenizer import bpe_merges, read_sentencepiece
from mixtral_infer.generation.chat import Conversation
from mixtral_infer.generation.chat_template import user_turn
from mixtral_infer.shipped import SHIPPED_MODELS

REPO = Path(__file__).resolve().parents[1]

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    " a leading space",
    "   three leading spaces and  two   inside",
    "trailing spaces   ",
    "new\nlines\n\nand a blank one\n",
    "\ttabs\tand\r\ncarriage returns",
    "digits 0123456789, 3.14159 and 1,000,000",
    "unicode: café naïve Ærø straße, 東京都, Ελληνικά, русский, 😀👍🏽",
    "ＦＵＬＬＷＩＤＴＨ ｔｅｘｔ and ligature ﬁ",
    "punctuation!?;:'\"()[]{}<>@#$%^&*_+=|\\/~`",
    "",
    " ",
]


@pytest.fixture(scope="session")
def converted_tiny_mixtral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "tiny-mixtral-hf"
    convert("tiny-mixtral", folder, to="hf")
    return folder


def auto_tokenizer(folder):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(folder)


def assert_same_encoding(ours: Tokenizer, theirs) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs.encode(text) == ids, text
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids), text


def test_bpe_merges_docstring_example():
    assert bpe_merges({"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "bc": 5}) == [("a", "b"), ("a", "bc"), ("ab", "c"), ("b", "c")]


def test_sentencepiece_fields_read_without_protobuf(tokenizer_path, v3_tokenizer_path):
    shipped = read_sentencepiece(SHIPPED_MODELS / "tiny-mixtral" / "tokenizer.model")
    assert (shipped.model_type, shipped.byte_fallback, shipped.precompiled_charsmap) == (2, True, b"")
    assert (shipped.add_dummy_prefix, shipped.remove_extra_whitespaces) == (True, False)
    assert (shipped.unk_id, shipped.bos_id, shipped.eos_id) == (0, 1, 2)
    assert [(p, t) for p, _, t in shipped.pieces[:4]] == [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("<0x00>", 6)]
    assert len(shipped.pieces) == Tokenizer(SHIPPED_MODELS / "tiny-mixtral" / "tokenizer.model").n_words
    nfkc = read_sentencepiece(tokenizer_path)  # trained with sentencepiece's defaults
    assert len(nfkc.precompiled_charsmap) > 1000 and nfkc.remove_extra_whitespaces
    v3 = read_sentencepiece(v3_tokenizer_path)
    assert [(p, t) for p, _, t in v3.pieces[3:6]] == [("[INST]", 3), ("[/INST]", 3), ("<tool>", 4)]
    processor = Tokenizer(v3_tokenizer_path)._model
    assert [s for _, s, _ in v3.pieces] == [processor.get_score(i) for i in range(len(v3.pieces))]


def test_converted_folder_tokenizes_in_transformers_as_here(converted_tiny_mixtral):
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (converted_tiny_mixtral / name).is_file(), name
    theirs = auto_tokenizer(converted_tiny_mixtral)
    ours = Tokenizer.from_folder("tiny-mixtral")
    assert_same_encoding(ours, theirs)
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.unk_token_id) == (1, 2, 0)
    assert theirs.encode("In the beginning") == [1, 1029, 261, 1916, 1286]  # <s> ▁In ▁the ▁begin ning


def test_greedy_generation_in_transformers_equals_ours(converted_tiny_mixtral):
    import transformers

    tokenizer = auto_tokenizer(converted_tiny_mixtral)
    hf = transformers.AutoModelForCausalLM.from_pretrained(converted_tiny_mixtral, dtype=torch.float32).eval()
    ours = load_model("tiny-mixtral", device="cpu", dtype=torch.float32)
    prompt = "And the LORD spake unto Moses, saying,"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=2)[0, ids.shape[1]:].tolist()
    generated, _ = generate([Tokenizer.from_folder("tiny-mixtral").encode(prompt)], ours, max_tokens=30)
    assert generated[0] == expected[: len(generated[0])]
    assert len(generated[0]) + ids.shape[1] > ours.args.sliding_window  # the cache has rotated
    assert tokenizer.decode(expected, skip_special_tokens=True).startswith(Tokenizer.from_folder("tiny-mixtral").decode(generated[0]))


def test_nfkc_tokenizer_with_extra_whitespace_removal_tokenizes_alike(tmp_path, model_folder):
    """sentencepiece's default normalization (nmt_nfkc, runs of spaces collapsed) carried into tokenizer.json."""
    convert(model_folder, tmp_path / "hf", to="hf")
    assert_same_encoding(Tokenizer.from_folder(model_folder), auto_tokenizer(tmp_path / "hf"))


def test_v3_folder_converts_and_tokenizes_alike(tmp_path, v3_folder):
    with pytest.warns(UserWarning, match=r"user-defined pieces \['<tool>'\]: in transformers, text right after one"):
        convert(v3_folder, tmp_path / "hf", to="hf")
    assert (tmp_path / "hf" / "tokenizer.model.v3").read_bytes() == (tmp_path / "hf" / "tokenizer.model").read_bytes()
    theirs = auto_tokenizer(tmp_path / "hf")
    ours = Tokenizer.from_folder(v3_folder)
    assert_same_encoding(ours, theirs)
    # In transformers the control pieces are special tokens that a chat template's text turns into their ids.
    assert theirs.convert_tokens_to_ids(["[INST]", "[/INST]"]) == [3, 4]
    assert theirs.encode("[INST]", add_special_tokens=False) == [3]
    assert 3 not in ours.encode("[INST]")  # sentencepiece never encodes text to a control piece
    # User-defined pieces: alike at the end of a text, not before more text (the module docstring says why).
    assert theirs.encode("x<tool>") == ours.encode("x<tool>")
    assert ours.encode("x<tool>y", bos=False) == [330, 363, 5, 359]  # ▁ x <tool> y
    assert theirs.encode("x<tool>y", add_special_tokens=False) == [330, 363, 5, 330, 359]  # ▁ x <tool> ▁ y


@pytest.mark.parametrize("missing", ["bos", "eos"])
def test_a_tokenizer_without_bos_or_eos_is_refused_before_anything_is_written(tmp_path, model_folder, missing):
    """sentencepiece trained with --bos_id=-1 encoded prompts as [-1, ...]: the command line failed
    after the model loaded ("token id -1 outside the vocabulary"), convert --to hf with an IndexError."""
    import inspect

    import sentencepiece as spm
    import torch.nn.modules.module as text_source

    lines = [line.strip() for line in inspect.getsource(text_source).splitlines() if line.strip()]
    ids = dict(bos_id=-1, eos_id=2) if missing == "bos" else dict(bos_id=1, eos_id=-1)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "tokenizer"), vocab_size=400,
                                   model_type="bpe", unk_id=0, pad_id=-1, byte_fallback=True, minloglevel=2, **ids)  # fmt: skip
    shutil.copyfile(tmp_path / "tokenizer.model", model_folder / "tokenizer.model")
    message = rf"tokenizer.model: defines no {missing.upper()} piece \({missing}_id=-1\): a Mistral model's prompts begin with <s>"
    with pytest.raises(CheckpointError, match=message):
        convert(model_folder, tmp_path / "hf", to="hf")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.partial-*"))
    result = in_process("demo", model_folder, "--max_tokens", "2")
    assert result.returncode == 1 and "loaded" not in result.stderr, result.stderr  # refused before the weights
    assert re.search(message, result.stderr.strip().splitlines()[-1])


def test_v3_tokenizer_formats_instruct_turns_with_control_tokens(v3_folder):
    tokenizer = Tokenizer.from_folder(v3_folder)
    assert tokenizer.path.name == "tokenizer.model.v3"
    assert tokenizer.version == "v3"
    question = tokenizer.encode("Who art thou?", bos=False)
    assert user_turn(tokenizer, "Who art thou?") == [3] + question + [4]
    model = load_model(v3_folder, device="cpu")
    conversation = Conversation(model, tokenizer, instruct=True, max_tokens=3)
    conversation.reply("Who art thou?")
    assert conversation.history[: len(question) + 3] == [1, 3] + question + [4]
    before = len(conversation.history)
    conversation.reply("Say more.")
    second = [3] + tokenizer.encode("Say more.", bos=False) + [4]  # no BOS on later turns
    assert conversation.history[before : before + len(second)] == second


def test_v1_tokenizer_formats_instruct_turns_as_text():
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    assert tokenizer.version == "v1"
    assert user_turn(tokenizer, "Who art thou?") == tokenizer.encode("[INST] Who art thou? [/INST]", bos=False)
    tags = tokenizer.encode("[INST]", bos=False)
    assert [tokenizer.id_to_piece(i) for i in tags] == ["\u2581", "<0x5B>", "I", "N", "S", "T", "<0x5D>"]


def test_command_line_reads_a_v3_folder(v3_folder):
    result = in_process("interactive", v3_folder, "--instruct", "--max_tokens", "4", "--temperature", "0", stdin="Hello\n")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr


def chat_ids(theirs, messages):
    text = theirs.apply_chat_template(messages, tokenize=False)
    return theirs.encode(text, add_special_tokens=False)


@pytest.mark.filterwarnings("ignore:.*user-defined pieces")
def test_chat_template_gives_our_instruct_ids_for_v1_and_v3(tmp_path, converted_tiny_mixtral, v3_folder):
    convert(v3_folder, tmp_path / "v3-hf", to="hf")
    messages = [
        {"role": "user", "content": "Who art thou?"},
        {"role": "assistant", "content": "I am that I am."},
        {"role": "user", "content": "Say more."},
    ]
    for source, converted in (("tiny-mixtral", converted_tiny_mixtral), (v3_folder, tmp_path / "v3-hf")):
        ours = Tokenizer.from_folder(source)
        theirs = auto_tokenizer(converted)
        answer = ours.encode("I am that I am.", bos=False)  # mistral-common encodes the answer alone
        expected = [1] + user_turn(ours, "Who art thou?") + answer + [2] + user_turn(ours, "Say more.")
        assert chat_ids(theirs, messages) == expected, ours.version
        assert chat_ids(theirs, messages[:1]) == [1] + user_turn(ours, "Who art thou?")
    assert expected[:2] == [1, 3]  # the v3 one starts <s> [INST]
