"""The tekken back-end: Mistral's ``tekken.json`` (Nemo 12B, Ministral 8B, Small 3), through
mistral-common, the library Mistral maintains.

A tekken file is tiktoken's byte-level BPE: ``vocab`` lists the regular tokens by rank, each as
its bytes (base64), the first 256 being the single bytes; ``config`` gives the pre-tokenizing
``pattern``, ``default_num_special_tokens`` (1,000) and ``default_vocab_size`` (131,072). Ids
``0 .. 999`` are the special tokens (``special_tokens``, or mistral-common's defaults in files
before v11: ``<unk> <s> </s> [INST] [/INST] ...``, then ``<SPECIAL_20>`` ... fillers), and
rank ``r`` of ``vocab`` is id ``1000 + r``, up to the vocabulary size (the file lists 150,000
ranks, of which the first 130,072 are used). No text encodes to a special token: ``"[INST]"``
is the text ``[ IN ST ]``.

Byte-level BPE adds no space before a text and decoding keeps every space: ``" unto"`` is one
token that decodes as ``" unto"`` at the start of a decode too. A character of several bytes
may be split over tokens (``😀`` is ``\\xf0\\x9f`` + ``\\x98`` + ``\\x80``); a decode that ends in
part of one ends in U+FFFD, which ``TextStream`` holds back.

The instruct format is the file's ``config.version``, rendered by mistral-common (``generation.chat_template``): v3 (Nemo):
``<s>[INST]u1[/INST]a1</s>[INST]system\\n\\nu2[/INST]``; v7 (Small 3): ``<s>[SYSTEM_PROMPT]system
[/SYSTEM_PROMPT][INST]u1[/INST]...``; v11 and later call tools as ``[TOOL_CALLS]name[ARGS]{...}``.

The file is checked before mistral-common reads it (``read_tekken``), so that a damaged one is a
``CheckpointError`` naming the file and the field, before any weight is read.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from mixtral_infer.errors import CheckpointError
from mixtral_infer.json_file import read_object
from mixtral_infer.tokenizer.base import Tokenizer, token_list

# The special tokens of tekken files that list none (before v11), as mistral-common defines them
# (Tekkenizer.DEPRECATED_SPECIAL_TOKENS); the rest up to default_num_special_tokens are fillers.
DEFAULT_SPECIALS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
)  # fmt: skip
FILLER = "<SPECIAL_{id}>"
REQUIRED_SPECIALS = ("<s>", "</s>", "[INST]", "[/INST]")  # prompts, answers and the instruct format need these
VERSIONS_WITHOUT_SPECIALS = ("v1", "v2", "v3", "v7")  # mistral-common's defaults apply up to v7


@dataclass(frozen=True)
class TekkenFile:
    """What a tekken file says, checked: the regular tokens' bytes by rank (cut at the vocabulary
    size), the special tokens' strings by id (fillers included), the pattern and the version."""

    path: Path
    vocab: List[bytes]
    specials: List[str]
    pattern: str
    version: str

    @property
    def n_words(self) -> int:
        return len(self.specials) + len(self.vocab)


def _positive_int(path: Path, config: Dict[str, Any], key: str) -> int:
    value = config.get(key)
    if type(value) is not int or value < 1:
        raise CheckpointError(f"{path}: config.{key}={value!r} must be a positive integer")
    return value


def read_tekken(path: Path) -> TekkenFile:
    """The tekken file at ``path``, checked field by field; ``CheckpointError`` naming the field.

    Checked: ``config`` (``pattern``, ``version``, ``default_num_special_tokens``,
    ``default_vocab_size`` between the special tokens' count and the special tokens plus the
    ``vocab`` entries, ``num_vocab_tokens`` equal to the entries), ``special_tokens`` (ranks
    ``0, 1, ...``, distinct, ``<s> </s> [INST] [/INST]`` among them) and the ``vocab`` entries
    used (rank ``r`` at position ``r``, base64 bytes, the first 256 the single bytes, distinct).
    """
    from mistral_common.tokens.tokenizers.base import TokenizerVersion

    data = read_object(path, CheckpointError)
    config, vocab = data.get("config"), data.get("vocab")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: config must be an object (pattern, default_vocab_size, ...)")
    if not isinstance(vocab, list):
        raise CheckpointError(f"{path}: vocab must be a list of {{rank, token_bytes, token_str}} entries")
    pattern, version = config.get("pattern"), config.get("version")
    if not isinstance(pattern, str) or not pattern:
        raise CheckpointError(f"{path}: config.pattern must be the pre-tokenizing regular expression")
    if version not in TokenizerVersion.__members__:
        raise CheckpointError(f"{path}: config.version={version!r} must be one of {', '.join(TokenizerVersion.__members__)}")
    n_special = _positive_int(path, config, "default_num_special_tokens")
    size = _positive_int(path, config, "default_vocab_size")
    listed = config.get("num_vocab_tokens", len(vocab))
    if listed != len(vocab):
        raise CheckpointError(f"{path}: config.num_vocab_tokens={listed!r}, but vocab has {len(vocab)} entries")
    if not n_special < size <= n_special + len(vocab):
        raise CheckpointError(
            f"{path}: config.default_vocab_size={size} must exceed config.default_num_special_tokens={n_special} "
            f"and be at most those plus the {len(vocab)} vocab entries ({n_special + len(vocab)})"
        )
    specials = _special_tokens(path, data.get("special_tokens"), version, n_special)
    return TekkenFile(path, _vocab_bytes(path, vocab[: size - n_special]), specials, pattern, version)


def _special_tokens(path: Path, entries: Any, version: str, n_special: int) -> List[str]:
    if entries is None:
        if version not in VERSIONS_WITHOUT_SPECIALS:
            raise CheckpointError(f"{path}: special_tokens missing: a {version} tekken file lists its special tokens")
        strings = list(DEFAULT_SPECIALS)
    else:
        if not isinstance(entries, list) or not all(
            isinstance(e, dict) and type(e.get("rank")) is int and isinstance(e.get("token_str"), str) for e in entries
        ):
            raise CheckpointError(f"{path}: special_tokens must be a list of {{rank, token_str, is_control}} entries")
        ranks = [e["rank"] for e in entries]
        if ranks != list(range(len(entries))):
            raise CheckpointError(f"{path}: special_tokens ranks {ranks[:8]} must be 0, 1, 2, ... in order")
        strings = [e["token_str"] for e in entries]
        if len(set(strings)) != len(strings):
            raise CheckpointError(f"{path}: special_tokens must be distinct strings")
    if len(strings) > n_special:
        raise CheckpointError(
            f"{path}: {len(strings)} special_tokens, more than config.default_num_special_tokens={n_special}"
        )
    missing = [token for token in REQUIRED_SPECIALS if token not in strings]
    if missing:
        raise CheckpointError(f"{path}: special_tokens lacks {' '.join(missing)} (prompts begin with <s>, answers "
                              "end with </s>, instructions sit between [INST] and [/INST])")  # fmt: skip
    return strings + [FILLER.format(id=i) for i in range(len(strings), n_special)]


def _vocab_bytes(path: Path, entries: List[Any]) -> List[bytes]:
    tokens: List[bytes] = []
    for rank, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("rank") != rank or not isinstance(entry.get("token_bytes"), str):
            raise CheckpointError(f"{path}: vocab[{rank}] must be {{rank: {rank}, token_bytes: <base64>, token_str}}")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, ValueError):
            raise CheckpointError(f"{path}: vocab[{rank}].token_bytes is not base64") from None
        if (rank < 256 and token != bytes([rank])) or not token:
            raise CheckpointError(f"{path}: vocab[{rank}].token_bytes={token!r}: ranks 0-255 are the single bytes")
        tokens.append(token)
    if len(set(tokens)) != len(tokens):
        raise CheckpointError(f"{path}: vocab holds the same token_bytes twice")
    return tokens


class TekkenTokenizer(Tokenizer):
    """A ``tekken.json`` read by mistral-common (module docstring)."""

    kind = "tekken"
    order = 1

    @classmethod
    def reads(cls, path: Path) -> bool:
        return path.suffix == ".json" and "tekken" in path.name

    def __init__(self, model_path: str | Path):
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        path = Path(model_path)
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer file not found")
        self.path = path
        self.file = read_tekken(path)
        try:
            self._mistral = MistralTokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 - its asserts and ValueErrors, said in one line
            lines = str(error).strip().splitlines()
            raise CheckpointError(f"{path}: mistral-common cannot read it ({type(error).__name__}: {lines[0] if lines else ''})") from None
        self._tekken = self._mistral.instruct_tokenizer.tokenizer
        self._n_special = len(self.file.specials)
        self._special_ids = {token: i for i, token in enumerate(self.file.specials)}

    @property
    def n_words(self) -> int:
        return self.file.n_words

    @property
    def bos_id(self) -> int:
        return self._special_ids["<s>"]

    @property
    def eos_id(self) -> int:
        return self._special_ids["</s>"]

    @property
    def version(self) -> str:
        """The file's ``config.version``: "v3" (Nemo), "v7" (Small 3), "v11", ..."""
        return self.file.version

    def _encode(self, text: str) -> List[int]:
        return self._tekken.encode(text, bos=False, eos=False)

    def decode(self, ids: List[int]) -> str:
        ids = token_list(ids)
        if any(not 0 <= i < self.file.n_words for i in ids):
            raise self._outside(ids)
        return self._tekken.decode(ids)  # special tokens left out

    def control_ids(self, *pieces: str) -> Optional[List[int]]:
        ids = [self._special_ids.get(piece) for piece in pieces]
        return None if None in ids else ids

    def is_control(self, token_id: int) -> bool:
        return 0 <= token_id < self._n_special

    def byte_value(self, token_id: int) -> Optional[int]:
        """The byte of ranks 0-255 (ids 1000-1255), the single bytes."""
        rank = token_id - self._n_special
        return rank if 0 <= rank < 256 else None

    def id_to_piece(self, token_id: int) -> str:
        """A special token's string; a regular token's text (U+FFFD for part of a character)."""
        self._check_id(token_id)
        if token_id < self._n_special:
            return self.file.specials[token_id]
        return self.file.vocab[token_id - self._n_special].decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        return b"" if token_id < self._n_special else self.file.vocab[token_id - self._n_special]

    def mistral_common(self):
        return self._mistral
