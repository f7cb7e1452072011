"""The files transformers' tokenizer reads, written from a sentencepiece ``tokenizer.model`` or a
tekken ``tekken.json`` (``write_hf_tekken_tokenizer``, at the end).

``AutoTokenizer.from_pretrained(folder)`` given only ``tokenizer.model`` needs protobuf
to convert it, and then guesses the special tokens. Hugging Face's own Mistral folders
ship ``tokenizer.json`` (the ``tokenizers`` library's description of the whole
pipeline), ``tokenizer_config.json`` and ``special_tokens_map.json``; this module
writes the same three from the sentencepiece model, with no protobuf: the model file
is a protobuf message, and the few fields needed are read by ``read_sentencepiece``.

The pipeline that encodes as sentencepiece does (tested against it on varied text):

* normalizer: the model's precompiled character map when it has one (``nmt_nfkc``),
  then, if ``remove_extra_whitespaces``, runs of spaces collapsed and the ends stripped;
  then one ``▁`` prepended and spaces replaced by ``▁``. (transformers' non-legacy
  ``Metaspace`` pre-tokenizer prepends nothing to a text that starts with a space, where
  sentencepiece does: ``" x"`` is ``▁▁x`` for sentencepiece);
* model: BPE over the vocabulary, with byte fallback; the merges are every split of a
  piece into two pieces of the vocabulary, ranked by the merged piece's id (a
  sentencepiece BPE vocabulary is sorted by merge order);
* control and user-defined pieces are added tokens, control ones special, so
  ``[INST]`` in a chat template's text is the single control token of a v3 tokenizer
  (sentencepiece itself never encodes text to a control piece);
* post-processor: ``<s>`` prepended;
* ``chat_template`` (in ``tokenizer_config.json``): the instruct format of
  ``generation.chat_template.user_turn``, so ``apply_chat_template`` gives mistral-common's ids.
  v1: ``<s>[INST] q [/INST] a</s>[INST] q2 [/INST]`` as text; v3:
  ``<s>[INST]q[/INST]a</s>...`` where the control tokens split the text and each part gets
  its ``▁`` prefix, giving ``[INST] ▁q [/INST] ▁a``.

One difference remains, for user-defined pieces (Mistral's v1 and v3 tokenizers have
none: their ``[INST]`` are control pieces). transformers splits added tokens out of the
text before normalizing, and normalizes each remaining part alone, so the part after
one gets its own ``▁`` prefix: ``"x<tool>y"`` is ``▁ x <tool> ▁ y`` there and
``▁ x <tool> y`` in sentencepiece (``"x<tool>"`` is alike in both). The other choice, transformers'
non-legacy ``Metaspace`` pre-tokenizer, gets these right but prepends nothing to a text
that starts with a space (``" x"`` is ``▁▁x`` in sentencepiece, ``▁x`` there). Exact
plain text is preferred here; ``write_hf_tokenizer`` warns when a model has user-defined pieces.
"""

from __future__ import annotations

import base64
import json
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from mixtral_infer.errors import CheckpointError
from mixtral_infer.tokenizer.json_tokenizer import byte_level_alphabet
from mixtral_infer.tokenizer.tekken_tokenizer import TekkenFile

# sentencepiece_model.proto: SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BPE = 2  # TrainerSpec.ModelType

# Jinja templates for transformers' apply_chat_template: user and assistant turns only.
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ BEGIN + message['content'] + END }}"
    "{% elif message['role'] == 'assistant' %}{{ GAP + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('only user and assistant messages, got ' + message['role']) }}{% endif %}"
    "{% endfor %}"
)
CHAT_TEMPLATES = {
    "v1": _CHAT_TEMPLATE.replace("BEGIN", "'[INST] '").replace("END", "' [/INST]'").replace("GAP", "' '"),
    "v3": _CHAT_TEMPLATE.replace("BEGIN", "'[INST]'").replace("END", "'[/INST]'").replace("GAP + ", ""),
}

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


@dataclass
class SentencePieceModel:
    """The fields of a sentencepiece ModelProto that decide how text is encoded."""

    pieces: List[Tuple[str, float, int]]  # (piece, score, type)
    model_type: int = 1  # UNIGRAM unless the trainer spec says otherwise
    byte_fallback: bool = False
    unk_id: int = 0  # sentencepiece's defaults, which are Mistral's
    bos_id: int = 1
    eos_id: int = 2
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True


def _fields(data: bytes) -> Iterator[Tuple[int, int, object]]:
    """(field number, wire type, value) of each field of one protobuf message.

    Varints are ints, length-delimited fields bytes, 32-bit fields the raw 4 bytes.
    """
    position = 0

    def varint() -> int:
        nonlocal position
        value = shift = 0
        while True:
            byte = data[position]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while position < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value: object = varint()
        elif wire == 1:
            value, position = data[position : position + 8], position + 8
        elif wire == 2:
            size = varint()
            value, position = data[position : position + size], position + size
        elif wire == 5:
            value, position = data[position : position + 4], position + 4
        else:
            raise ValueError(f"protobuf wire type {wire} not supported")
        yield number, wire, value


def read_sentencepiece(path: str | Path) -> SentencePieceModel:
    """The pieces and normalization settings of a sentencepiece model file."""
    path = Path(path)
    try:
        model = SentencePieceModel(pieces=[])
        for number, _, value in _fields(path.read_bytes()):
            if number == 1:  # repeated SentencePiece {1: piece, 2: score, 3: type}
                piece, score, kind = "", 0.0, NORMAL
                for field, _, inner in _fields(value):
                    if field == 1:
                        piece = inner.decode("utf-8")
                    elif field == 2:
                        score = struct.unpack("<f", inner)[0]
                    elif field == 3:
                        kind = inner
                model.pieces.append((piece, score, kind))
            elif number == 2:  # TrainerSpec {3: model_type, 35: byte_fallback, 40-42: unk/bos/eos ids}
                for field, _, inner in _fields(value):
                    if field == 3:
                        model.model_type = inner
                    elif field == 35:
                        model.byte_fallback = bool(inner)
                    elif field in (40, 41, 42):
                        setattr(model, {40: "unk_id", 41: "bos_id", 42: "eos_id"}[field], inner)
            elif number == 3:  # NormalizerSpec {2: charsmap, 3: add_dummy_prefix, 4: remove_extra_whitespaces}
                for field, _, inner in _fields(value):
                    if field == 2:
                        model.precompiled_charsmap = inner
                    elif field == 3:
                        model.add_dummy_prefix = bool(inner)
                    elif field == 4:
                        model.remove_extra_whitespaces = bool(inner)
    except (IndexError, ValueError, UnicodeDecodeError, struct.error) as error:
        raise CheckpointError(f"{path}: not a sentencepiece model ({error})") from None
    if not model.pieces:
        raise CheckpointError(f"{path}: not a sentencepiece model (no pieces)")
    return model


def bpe_merges(vocab: Dict[str, int]) -> List[Tuple[str, str]]:
    """Every split of a piece into two pieces of ``vocab``, ordered by the merged piece's id.

    >>> bpe_merges({"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "bc": 5})
    [('a', 'b'), ('a', 'bc'), ('ab', 'c'), ('b', 'c')]
    """
    merges = []
    for piece, piece_id in vocab.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        merges += [(piece_id, vocab[left], vocab[right], left, right) for left, right in splits]
    return [(left, right) for *_, left, right in sorted(merges)]


def bos_first(bos: str, bos_id: int) -> dict:
    """tokenizer.json's post-processor that puts ``bos`` (id ``bos_id``) before each sequence, as transformers writes it."""
    return {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }


def tokenizer_json(model: SentencePieceModel, source: str = "tokenizer.model") -> dict:
    """The ``tokenizers`` pipeline that encodes as the sentencepiece model does."""
    if model.model_type != BPE:
        raise CheckpointError(f"{source}: only BPE sentencepiece models can be written for transformers (Mistral's are)")
    pieces = model.pieces
    vocab = {piece: i for i, (piece, _, kind) in enumerate(pieces)}
    unk = pieces[model.unk_id][0]
    mergeable = {piece: i for i, (piece, _, kind) in enumerate(pieces) if kind == NORMAL}
    added = [
        {"id": i, "content": piece, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": kind != USER_DEFINED}
        for i, (piece, _, kind) in enumerate(pieces)
        if kind in (UNKNOWN, CONTROL, USER_DEFINED)
    ]
    normalizers = []
    if model.precompiled_charsmap:
        normalizers.append({"type": "Precompiled", "precompiled_charsmap": base64.b64encode(model.precompiled_charsmap).decode()})
    if model.remove_extra_whitespaces:
        normalizers += [
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
            {"type": "Strip", "strip_left": True, "strip_right": True},
        ]
    if model.add_dummy_prefix:
        normalizers.append({"type": "Prepend", "prepend": "\u2581"})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"})
    bos = pieces[model.bos_id][0]
    decoders = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if model.add_dummy_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": bos_first(bos, model.bos_id),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": model.byte_fallback,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [list(pair) for pair in bpe_merges(mergeable)],
        },
    }


def instruct_version(model: SentencePieceModel) -> str:
    """The instruct format: "v3" when [INST] and [/INST] are control pieces (as ``Tokenizer.version``), else "v1"."""
    control = {piece for piece, _, kind in model.pieces if kind == CONTROL}
    return "v3" if {"[INST]", "[/INST]"} <= control else "v1"


def write_hf_tokenizer(tokenizer_path: str | Path, folder: str | Path, added: Sequence = (),
                       eos_token: Optional[str] = None) -> List[Path]:  # fmt: skip
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``folder``; with a
    fine-tune's ``added`` tokens (``tokenizer.AddedToken``s past the model's pieces) and its end token."""
    folder = Path(folder)
    model = read_sentencepiece(tokenizer_path)
    pipeline = tokenizer_json(model, str(tokenizer_path))
    pipeline["added_tokens"] += [
        {"id": token.id, "content": token.content, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": token.special}
        for token in added
    ]  # fmt: skip
    user_defined = [piece for piece, _, kind in model.pieces if kind == USER_DEFINED]
    if user_defined:
        warnings.warn(
            f"{tokenizer_path}: user-defined pieces {user_defined[:5]}: in transformers, text right after one "
            "may encode differently (see mixtral_infer.checkpoint.hf_tokenizer)", stacklevel=2
        )
    unk, bos, eos = (model.pieces[i][0] for i in (model.unk_id, model.bos_id, model.eos_id))
    special = {"bos_token": bos, "eos_token": eos_token or eos, "unk_token": unk}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": 1000000000000000019884624838656,
        "chat_template": CHAT_TEMPLATES[instruct_version(model)],
        **special,
        "added_tokens_decoder": {
            str(token["id"]): {key: value for key, value in token.items() if key != "id"} for token in pipeline["added_tokens"]
        },
    }
    files = {TOKENIZER_JSON: pipeline, TOKENIZER_CONFIG: config, SPECIAL_TOKENS_MAP: special}
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [folder / name for name in files]


# ---- tekken


def tekken_tokenizer_json(tekken: TekkenFile) -> dict:
    """The ``tokenizers`` pipeline that encodes as the tekken file does (tested against
    mistral-common and transformers' own conversion): text split by the file's pattern, each
    part's bytes written as GPT-2's printable characters (``ByteLevel``), then BPE over the
    ranks with a whole part taken as one token when it is one (``ignore_merges``, as tiktoken
    does); the merges are every split of a token into two tokens, ranked by the merged token's
    rank (``bpe_merges``). Special tokens are ids ``0 .. 999``, added tokens marked special; regular
    rank ``r`` is id ``1000 + r``; ``<s>`` is prepended."""
    alphabet = byte_level_alphabet()
    first = len(tekken.specials)
    ranks = {"".join(alphabet[b] for b in token): rank for rank, token in enumerate(tekken.vocab)}
    merges = bpe_merges(ranks)
    vocab = {**{token: i for i, token in enumerate(tekken.specials)}, **{token: first + rank for token, rank in ranks.items()}}
    added = [
        {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        for i, token in enumerate(tekken.specials)
    ]  # fmt: skip
    bos = "<s>"
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": tekken.pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": bos_first(bos, vocab[bos]),
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": [list(pair) for pair in merges],
        },
    }


def tekken_chat_template(tekken: TekkenFile) -> str:
    """The Jinja chat template mistral-common writes for the file's version, else the v3 template above."""
    try:
        from mistral_common.integrations.chat_templates.chat_templates import convert_tokenizer_to_chat_template

        return convert_tokenizer_to_chat_template(tekken.path)
    except Exception:  # noqa: BLE001 - an older mistral-common, or a version it writes no template for
        return CHAT_TEMPLATES["v3"]


def write_hf_tekken_tokenizer(tekken: TekkenFile, folder: str | Path) -> List[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for a tekken file
    (``tokenizer.tekken_tokenizer.read_tekken``) into ``folder``: what transformers' fast tokenizer
    reads in a hub folder of a tekken model."""
    folder = Path(folder)
    pipeline = tekken_tokenizer_json(tekken)
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if special["unk_token"] not in tekken.specials:
        del special["unk_token"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1000000000000000019884624838656,
        "chat_template": tekken_chat_template(tekken),
        **special,
    }
    files = {TOKENIZER_JSON: pipeline, TOKENIZER_CONFIG: config, SPECIAL_TOKENS_MAP: special}
    for name, content in files.items():  # tokenizer.json on one line: its 270,000 merges would take a million
        text = json.dumps(content, indent=None if name == TOKENIZER_JSON else 2, ensure_ascii=False)
        (folder / name).write_text(text + "\n", encoding="utf-8")
    return [folder / name for name in files]
