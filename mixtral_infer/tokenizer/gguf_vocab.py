"""A GGUF file's vocabulary as a sentencepiece model, built in memory.

llama.cpp's converter stores a sentencepiece vocabulary (``tokenizer.ggml.model == "llama"``: Mistral
7B, Mixtral 8x7B) as lists: ``tokenizer.ggml.tokens``, ``.scores``, ``.token_type`` (1 normal,
2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte) and the ids of ``bos``/``eos``/``unk``.
They are written back into a sentencepiece ``ModelProto`` (serialized here, without protobuf): a BPE model with byte fallback and
the normalizer of Mistral's ``tokenizer.model`` (a dummy prefix, whitespace escaped to ``▁``,
extra whitespace kept, no Unicode normalization), which encodes as the original file does.
Other vocabularies (``gpt2``-style BPE, tekken) are refused in one line.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

from mixtral_infer.errors import CheckpointError
from mixtral_infer.gguf_reader import field, open_reader

_PIECE_TYPES = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}  # gguf's token_type -> ModelProto.SentencePiece.Type (same numbers)


def sentencepiece_proto(path: Path) -> bytes:
    """The serialized sentencepiece ``ModelProto`` of the vocabulary in GGUF file ``path``."""
    value = functools.partial(field, open_reader(path))  # value(key, default): the metadata of key
    model = value("tokenizer.ggml.model")
    if model != "llama":
        raise CheckpointError(f"{path}: tokenizer.ggml.model={model!r}; only sentencepiece vocabularies ('llama') are read")
    tokens, scores, types = value("tokenizer.ggml.tokens"), value("tokenizer.ggml.scores"), value("tokenizer.ggml.token_type")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens missing or empty")
    scores = scores if isinstance(scores, list) else [0.0] * len(tokens)
    types = types if isinstance(types, list) else [1] * len(tokens)
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens, .scores and .token_type differ in length")
    pieces = []
    for token, score, kind in zip(tokens, scores, types):
        if kind not in _PIECE_TYPES or not isinstance(token, str):
            raise CheckpointError(f"{path}: token {token!r} has token_type {kind!r}, expected 1-6")
        pieces.append(_message(1, _bytes(1, token.encode("utf-8")) + _float(2, float(score)) + _varint_field(3, kind)))
    spec = b"".join([
        _varint_field(3, 2),  # model_type: BPE
        _varint_field(4, len(tokens)),  # vocab_size
        _varint_field(35, 1),  # byte_fallback
        _varint_field(40, int(value("tokenizer.ggml.unknown_token_id", 0))),
        _varint_field(41, int(value("tokenizer.ggml.bos_token_id", 1))),
        _varint_field(42, int(value("tokenizer.ggml.eos_token_id", 2))),
        _varint_field(43, int(value("tokenizer.ggml.padding_token_id", -1))),
    ])
    normalizer = b"".join([
        _bytes(1, b"identity"),  # name: no Unicode normalization
        _varint_field(3, int(bool(value("tokenizer.ggml.add_space_prefix", True)))),  # add_dummy_prefix
        _varint_field(4, 0),  # remove_extra_whitespaces
        _varint_field(5, 1),  # escape_whitespaces
    ])
    return b"".join(pieces) + _message(2, spec) + _message(3, normalizer)


# sentencepiece's ModelProto (sentencepiece_model.proto), written by hand: its generated Python module
# needs protobuf, which this package does not otherwise depend on. ModelProto: pieces = 1, trainer_spec = 2,
# normalizer_spec = 3; SentencePiece: piece = 1, score = 2, type = 3; TrainerSpec: model_type = 3,
# vocab_size = 4, byte_fallback = 35, unk_id .. pad_id = 40 .. 43; NormalizerSpec: name = 1,
# add_dummy_prefix = 3, remove_extra_whitespaces = 4, escape_whitespaces = 5.


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int32 is written as its 64-bit two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _varint_field(number: int, n: int) -> bytes:
    return _varint(number << 3) + _varint(n)


def _bytes(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


_message = _bytes


def _float(number: int, x: float) -> bytes:
    return _varint(number << 3 | 5) + struct.pack("<f", x)
