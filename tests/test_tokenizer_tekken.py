"""The tekken back-end (tokenizer/tekken_tokenizer.py): encodes and decodes as mistral-common on
Mistral's own tekken file, streams whole characters, renders the instruct formats as
mistral-common, drives llguidance's masks, and refuses damaged files in one line."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace
from pathlib import Path

import jsonschema
import pytest
import torch

import mistral_common
from mixtral_infer import CheckpointError, GenerationError, Tokenizer, load_model
from mixtral_infer.checkpoint.loading import Checkpoint, save_consolidated
from mixtral_infer.generation.text_stream import TextStream
from mixtral_infer.generation.chat_template import has_tool_pieces, render_messages, render_turns, user_turn
from mixtral_infer.structured.grammar import Constraint, RowGrammar, check_constraint, fill_bitmask, ll_tokenizer
from mixtral_infer.structured.logits import apply_bitmask
from mixtral_infer.tokenizer import find_tokenizer
from mixtral_infer.tokenizer.tekken_tokenizer import TekkenTokenizer

from conftest import random_model, tiny_args

TEKKEN = Path(mistral_common.__file__).parent / "data" / "tekken_240911.json"  # Mistral's own, 131,072 ids
KJV = (Path(__file__).parent / "data" / "kjv_heldout.txt").read_text(encoding="utf-8")

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    " unto them, and  two   spaces",
    "new\nlines\n\nand a blank one\n\ttab\r\n",
    "digits 0123456789, 3.14159 and 1,000,000",
    "café naïve Ærø straße, Ελληνικά, русский, עברית, العربية",
    "中文：你好，世界。日本語のテキスト、한국어",
    "emoji 😀👍🏽👨‍👩‍👧 and flags 🇫🇷",
    "punctuation!?;:'\"()[]{}<>@#$%^&*_+=|\\/~`",
    "[INST] not an instruction [/INST] <s> nor </s> [TOOL_CALLS] <unk>",
    "",
    " ",
    KJV[:3000],
]


@pytest.fixture(scope="module")
def tekken_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tekken")
    shutil.copyfile(TEKKEN, folder / "tekken.json")
    return folder


@pytest.fixture(scope="module")
def tekken(tekken_folder) -> Tokenizer:
    return Tokenizer.from_folder(tekken_folder)


@pytest.fixture(scope="module")
def reference():
    """mistral-common's own: the MistralTokenizer, and its Tekkenizer."""
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(str(TEKKEN))


def small_tekken(folder: Path, version: str = "v3", n_vocab: int = 2000, specials=None, **config) -> Path:
    """A tekken file from the first ``n_vocab`` ranks of Mistral's (a valid BPE: a rank's token is
    made of lower ranks), with ``config`` changes and ``specials`` (a list of strings) listed."""
    data = json.loads(TEKKEN.read_text(encoding="utf-8"))
    data.pop("image", None)
    data["vocab"] = data["vocab"][:n_vocab]
    data["config"].update(num_vocab_tokens=n_vocab, default_vocab_size=1000 + n_vocab, version=version)
    data["config"].update(config)
    if specials is not None:
        data["special_tokens"] = [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(specials)]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tekken.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


V11_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
                "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]"]  # fmt: skip


def test_a_folder_with_tekken_json_loads(tekken, tekken_folder):
    assert find_tokenizer(tekken_folder) == tekken_folder / "tekken.json"
    assert isinstance(tekken, TekkenTokenizer) and isinstance(tekken, Tokenizer) and tekken.kind == "tekken"
    assert (tekken.n_words, tekken.bos_id, tekken.eos_id, tekken.version, tekken.chat_format) == (131072, 1, 2, "v3", "v3")
    assert tekken.control_ids("[INST]", "[/INST]") == [3, 4] and tekken.control_ids("[INST]", "nope") is None
    assert [tekken.is_control(i) for i in (0, 1, 999, 1000, 131071)] == [True, True, True, False, False]
    assert isinstance(Tokenizer(tekken_folder / "tekken.json"), TekkenTokenizer)


def test_encode_and_decode_equal_mistral_common(tekken, reference):
    theirs = reference.instruct_tokenizer.tokenizer
    for text in TEXTS:
        ids = tekken.encode(text, bos=True, eos=True)
        assert ids == theirs.encode(text, bos=True, eos=True), text
        assert tekken.decode(ids) == theirs.decode(ids) == text, text
    assert tekken.encode("In the beginning", bos=False) == [1785, 1278, 10343]
    assert tekken.encode("你好，世界", bos=False) == [124108, 1625, 29659]


def test_control_tokens_never_come_from_text(tekken):
    ids = tekken.encode("[INST] hi </s><s>[/INST][TOOL_CALLS]", bos=False)
    assert not any(tekken.is_control(i) for i in ids)
    assert ids[:4] == [1091, 3174, 3074, 1093]  # "[" "IN" "ST" "]"
    assert tekken.decode(ids) == "[INST] hi </s><s>[/INST][TOOL_CALLS]"
    assert tekken.decode([1, 3] + tekken.encode("hi", bos=False) + [4, 2]) == "hi"  # control tokens write nothing


def test_per_token_methods_equal_mistral_common(tekken, reference):
    theirs = reference.instruct_tokenizer.tokenizer
    for token in [0, 1, 3, 999, 1000, 1032, 1255, 1256, 22177, 57506, 119685, 131071]:
        assert tekken.id_to_piece(token) == theirs.id_to_piece(token), token
        assert tekken.token_bytes(token) == theirs.id_to_byte_piece(token), token
    assert tekken.byte_value(1000 + 0x41) == 0x41 and tekken.byte_value(1256) is None and tekken.byte_value(3) is None
    assert tekken.token_bytes(57506) == b" unto" and tekken.token_bytes(3) == b""
    with pytest.raises(GenerationError, match=r"^token id 131072 is outside this tokenizer's vocabulary \[0, 131072\)$"):
        tekken.decode([1, 131072])
    with pytest.raises(GenerationError, match="token id -1"):
        tekken.id_to_piece(-1)


def test_decode_continuation_keeps_the_leading_space(tekken):
    unto = tekken.encode(" unto", bos=False)
    assert unto == [57506]
    assert tekken.decode(unto) == tekken.decode_continuation(unto) == " unto"
    assert tekken.decode_continuation(tekken.encode("them", bos=False)) == "them"
    assert tekken.encode_continuation(" unto") == unto and tekken.encode_continuation("\n}") == tekken.encode("\n}", bos=False)


@pytest.mark.parametrize("leading_space", [False, True])
def test_streamed_text_never_splits_a_character(tekken, leading_space):
    text = " Praise 😀👍🏽 你好世界 café 🇫🇷 — ok"
    tokens = tekken.encode(text, bos=False)
    assert len(tokens) > len(text.split())  # emoji and CJK span several byte tokens
    stream = TextStream(tekken, leading_space=leading_space)
    pieces = [stream.push(token) for token in tokens] + [stream.finish()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces[:-1]  # some pushes held back part of a character
    assert all(piece.encode("utf-8").decode("utf-8") == piece for piece in pieces)


def test_the_instruct_format_is_mistral_common_s(tekken, reference):
    """v3 tekken (Nemo): [INST] + text + [/INST] with no space added; the system prompt joins the
    last user turn; and the sentencepiece v3 rule (chat_template's, for a tokenizer mistral-common does
    not render) gives the same ids."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    hi = tekken.encode("hi", bos=False)
    assert user_turn(tekken, "hi") == [3, *hi, 4]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]  # fmt: skip
    ids = render_messages(tekken, messages)
    assert ids == reference.encode_chat_completion(ChatCompletionRequest.from_openai(messages)).tokens
    enc = lambda text: tekken.encode(text, bos=False)  # noqa: E731
    assert ids == [1, 3, *enc("u1"), 4, *enc("a1"), 2, 3, *enc("Be brief.\n\nu2"), 4]
    as_v3_sentencepiece = SimpleNamespace(kind="sentencepiece", chat_format="v3", version="v3", bos_id=tekken.bos_id, eos_id=tekken.eos_id,
                                          encode=tekken.encode, control_ids=tekken.control_ids)  # fmt: skip
    assert ids == render_turns(as_v3_sentencepiece, ["Be brief."], [("user", "u1"), ("assistant", "a1"), ("user", "u2")])


@pytest.mark.parametrize("version", ["v7", "v11"])
def test_v7_and_later_put_the_system_prompt_first(tmp_path, version):
    path = small_tekken(tmp_path, version, specials=V11_SPECIALS if version == "v11" else None)
    tokenizer = Tokenizer(path)
    assert (tokenizer.version, tokenizer.n_words) == (version, 3000)
    enc = lambda text: tokenizer.encode(text, bos=False)  # noqa: E731
    ids = render_turns(tokenizer, ["Be brief."], [("user", "u1"), ("assistant", "a1"), ("user", "u2")])
    assert ids == [1, 17, *enc("Be brief."), 18, 3, *enc("u1"), 4, *enc("a1"), 2, 3, *enc("u2"), 4]
    assert has_tool_pieces(tokenizer) == (version == "v7")  # v11 calls tools as name[ARGS]{...}: the text format


def test_a_conversation_with_tools_is_mistral_common_s(tekken, reference):
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    weather = {"name": "get_weather", "description": "Weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert has_tool_pieces(tekken)
    ids = render_messages(tekken, messages, [weather])
    request = ChatCompletionRequest.from_openai(messages, tools=[{"type": "function", "function": weather}])
    assert ids == reference.encode_chat_completion(request).tokens and 5 in ids  # [AVAILABLE_TOOLS]


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["psalm", "proverb"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "ok"],
    "additionalProperties": False,
}


def test_the_grammar_bridge_gives_each_token_its_bytes(tekken):
    ll = ll_tokenizer(tekken)
    for text in ("unto them", " 你好 😀", "{\"a\": 1}"):
        assert ll.decode_bytes(tekken.encode(text, bos=False)) == text.encode()
    assert ll.decode_bytes([1000 + 0xF0]) == b"\xf0"  # part of a character: its byte
    assert ll.is_special_token(tekken.eos_id) and ll.is_special_token(3) and not ll.is_special_token(57506)


def test_random_walks_through_a_json_schema_stay_valid(tekken):
    """Random logits over the whole tekken vocabulary, masked by the grammar: the first token must
    start with ``{``, and each walk ends in JSON that validates, its strings drawn from any tokens
    (parts of characters included)."""
    grammar = check_constraint(Constraint("json_schema", SCHEMA), tekken)
    first = RowGrammar(grammar, tekken)
    allowed = torch.isfinite(apply_bitmask(torch.zeros(1, tekken.n_words), fill_bitmask([first], tekken.n_words))[0])
    starts = {tekken.token_bytes(i)[:1] for i in torch.nonzero(allowed)[:, 0].tolist()}
    assert starts == {b"{"} and not allowed[tekken.encode(" {", bos=False)[0]]  # no leading space
    rng = torch.Generator().manual_seed(0)
    closing = [i for i in range(tekken.n_words) if tekken.token_bytes(i) in (b'"', b"}", b'",', b'"}')]
    texts = []
    for walk in range(6):
        row, tokens = RowGrammar(grammar, tekken), []
        for _ in range(120):
            logits = torch.randn(1, tekken.n_words, generator=rng)
            if walk % 2:  # half the walks favour closing quotes and braces, so that strings end early
                logits[0, closing] += 4.0
            logits = apply_bitmask(logits, fill_bitmask([row], tekken.n_words))[0]
            token = int(torch.argmax(logits))
            if token == tekken.eos_id:
                break
            row.accept(token)
            tokens.append(token)
            if row.done:
                break
        texts.append(tekken.decode(tokens))
        jsonschema.validate(json.loads(texts[-1]), SCHEMA)
    assert any(not text.isascii() for text in texts)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(config=dict(default_vocab_size=2_000_000)),
         "config.default_vocab_size=2000000 must exceed config.default_num_special_tokens=1000 and be at most those "
         "plus the 2000 vocab entries (3000)"),
        (dict(config=dict(default_vocab_size=1000)), "config.default_vocab_size=1000 must exceed"),
        (dict(config=dict(num_vocab_tokens=150000)), "config.num_vocab_tokens=150000, but vocab has 2000 entries"),
        (dict(config=dict(default_num_special_tokens=10, default_vocab_size=2010)),
         "20 special_tokens, more than config.default_num_special_tokens=10"),
        (dict(config=dict(version="v99")), "config.version='v99' must be one of"),
        (dict(config=dict(pattern=None)), "config.pattern must be the pre-tokenizing regular expression"),
        (dict(specials=[s for s in V11_SPECIALS if s not in ("<s>", "[INST]")]), "special_tokens lacks <s> [INST]"),
        (dict(specials=["<unk>", "</s>", "</s>"]), "special_tokens must be distinct strings"),
        (dict(specials=None, version="v11"), "special_tokens missing: a v11 tekken file lists its special tokens"),
        (dict(vocab=lambda v: [*v[:5], {**v[5], "rank": 6}, *v[6:]]), "vocab[5] must be {rank: 5, token_bytes: <base64>, token_str}"),
        (dict(vocab=lambda v: [{**v[0], "token_bytes": "QQ=="}] + v[1:]), "vocab[0].token_bytes=b'A': ranks 0-255 are the single bytes"),
        (dict(vocab=lambda v: [*v[:300], {**v[300], "token_bytes": v[299]["token_bytes"]}, *v[301:]]),
         "vocab holds the same token_bytes twice"),
        (dict(vocab=lambda v: [*v[:300], {**v[300], "token_bytes": "not base64!"}, *v[301:]]), "vocab[300].token_bytes is not base64"),
    ],
)  # fmt: skip
def test_a_damaged_tekken_file_is_one_line_naming_the_field(tmp_path, change, message):
    version = change.get("version", "v11" if "specials" in change else "v3")
    specials = change.get("specials", V11_SPECIALS if version == "v11" and "specials" not in change else None)
    path = small_tekken(tmp_path, version, specials=specials)
    data = json.loads(path.read_text(encoding="utf-8"))
    data["config"].update(change.get("config", {}))
    if data["config"].get("pattern") is None:
        del data["config"]["pattern"]
    if "vocab" in change:
        data["vocab"] = change["vocab"](data["vocab"])
        data["config"]["num_vocab_tokens"] = len(data["vocab"])
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(CheckpointError) as raised:
        Tokenizer(path)
    assert str(raised.value).startswith(f"{path}: ") and message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_model_with_a_damaged_tekken_file_is_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    import dataclasses

    folder = tmp_path / "model"
    save_consolidated(random_model(dataclasses.replace(tiny_args(moe=False), vocab_size=3000)), folder)
    small_tekken(folder)
    assert load_model(folder, device="cpu", dtype=torch.float32).args.vocab_size == Tokenizer.from_folder(folder).n_words
    data = json.loads((folder / "tekken.json").read_text(encoding="utf-8"))
    data["special_tokens"] = [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(V11_SPECIALS[2:])]
    (folder / "tekken.json").write_text(json.dumps(data), encoding="utf-8")
    monkeypatch.setattr(Checkpoint, "published_tensors", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(CheckpointError, match=r"tekken\.json: special_tokens lacks <s>$|tekken\.json: special_tokens lacks <s> "):
        load_model(folder, device="cpu", dtype=torch.float32)


def test_a_tiny_model_with_a_tekken_tokenizer_generates_text(tmp_path):
    import dataclasses

    from mixtral_infer import LLM, SamplingParams

    folder = tmp_path / "model"
    save_consolidated(random_model(dataclasses.replace(tiny_args(moe=True), vocab_size=3000), seed=3), folder)
    small_tekken(folder)
    llm = LLM(str(folder), device="cpu", dtype=torch.float32)
    assert isinstance(llm.tokenizer, TekkenTokenizer)
    completion = llm.generate(["In the beginning"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert completion.text == llm.tokenizer.decode(completion.token_ids) and len(completion.token_ids) == 8
