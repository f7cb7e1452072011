"""The ``tokenizer.json`` back-end: a Hugging Face folder with no ``tokenizer.model`` nor
``tekken.json`` (the hub's folders of tekken models: Mistral Nemo, Ministral, Small 3), read by
the ``tokenizers`` library, as transformers' fast tokenizer reads it.

- **BOS and EOS** are ``bos_token`` and ``eos_token`` of ``special_tokens_map.json``, else of
  ``tokenizer_config.json`` (as for sentencepiece's fine-tunes), else ``<s>`` and ``</s>``.
- **Control tokens** are the special added tokens (``<s>``, ``[INST]``, ...): no text encodes to
  them (``encode_special_tokens``: ``"[INST]"`` is its characters, as mistral-common encodes it;
  transformers would give the token), and decoding leaves them out (``skip_special_tokens``).
  Added tokens that are not special match their strings in text, as transformers does.
- **Bytes of a token.** A byte-level model (a ``ByteLevel`` decoder: tekken's conversion) writes
  each byte as a printable character (GPT-2's table: ``Ġ`` is the space, ``Ċ`` the newline);
  ``token_bytes`` maps them back. Otherwise pieces are sentencepiece's (``▁`` the space,
  ``<0x0A>`` a byte-fallback byte).
- **Instruct format**: "v3" when ``[INST]`` and ``[/INST]`` are special tokens, else "v1"; the
  folder does not say where a v7 model wants its system prompt (its ``tekken.json`` does, and is
  read first when the folder has one).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Optional

from mixtral_infer.errors import CheckpointError
from mixtral_infer.tokenizer.base import BEGIN_INST, END_INST, IM_END, IM_START, Tokenizer, configured_token, token_list

BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_alphabet() -> Dict[int, str]:
    """GPT-2's table from bytes to the printable characters a byte-level vocabulary writes them
    as: the printable Latin-1 bytes stand for themselves, the other 68 are ``chr(256 + k)``
    (``0x20`` is ``Ġ``, ``0x0A`` is ``Ċ``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + k) for k, b in enumerate(others)}}


BYTE_OF_CHARACTER = {character: byte for byte, character in byte_level_alphabet().items()}


class JsonTokenizer(Tokenizer):
    """A ``tokenizer.json`` read by Hugging Face's tokenizers (module docstring)."""

    kind = "tokenizer.json"
    order = 0

    @classmethod
    def reads(cls, path: Path) -> bool:
        return path.name == "tokenizer.json"

    def __init__(self, model_path: str | Path):
        from tokenizers import Tokenizer as HfTokenizer

        path = Path(model_path)
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer file not found")
        try:
            self._hf = HfTokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 - the library's one exception type for every fault
            lines = str(error).strip().splitlines()
            raise CheckpointError(f"{path}: not a tokenizer.json the tokenizers library reads ({lines[0] if lines else error})") from None
        self.path = path
        self._hf.no_padding()
        self._hf.no_truncation()
        self._hf.encode_special_tokens = True  # special tokens' strings are text
        added = self._hf.get_added_tokens_decoder()
        self._special = {i: token.content for i, token in added.items() if token.special}
        self._added = {token.content: i for i, token in added.items()}
        self._special_ids = {content: i for i, content in self._special.items()}
        self._n_words = self._hf.get_vocab_size(with_added_tokens=True)
        decoder = json.loads(self._hf.decoder.__getstate__()) if self._hf.decoder is not None else {}
        self._byte_level = '"ByteLevel"' in json.dumps(decoder)
        self._bos_id = self._configured("bos_token", "<s>")
        self._eos_id = self._configured("eos_token", "</s>")

    def _configured(self, key: str, default: str) -> int:
        """The id of ``key``'s token (``configured_token``), else of ``default``."""
        configured = configured_token(self.path.parent, key)
        where, content = configured if configured is not None else (self.path, default)
        token_id = self._hf.token_to_id(content)
        if token_id is None:
            named = f"{key} {content!r}" if configured is not None else f"no {key} in {self.path.parent}, and {content!r}"
            raise CheckpointError(f"{where}: {named} is not a token of {self.path.name}: "
                                  "a Mistral model's prompts begin with <s> and its answers end with </s>")  # fmt: skip
        return token_id

    @property
    def n_words(self) -> int:
        return self._n_words

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def version(self) -> str:
        return "v3" if self.control_ids(BEGIN_INST, END_INST) is not None else "v1"

    def _encode(self, text: str) -> List[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_continuation(self, text: str) -> List[int]:
        """Without a space before ``text``: byte-level models add none; a sentencepiece-like one
        (``▁`` pieces) gets it encoded after a newline, whose ids are then left out."""
        if self._byte_level:
            return self.encode(text, bos=False)
        newline = self._encode("\n")
        ids = self._encode("\n" + text)
        return ids[len(newline) :] if ids[: len(newline)] == newline else ids

    def decode(self, ids: List[int]) -> str:
        ids = token_list(ids)
        if any(not 0 <= i < self._n_words for i in ids):
            raise self._outside(ids)
        return self._hf.decode(ids, skip_special_tokens=True)

    def control_ids(self, *pieces: str) -> Optional[List[int]]:
        ids = [self._special_ids.get(piece) for piece in pieces]
        return None if None in ids else ids

    def is_control(self, token_id: int) -> bool:
        return token_id in self._special

    def chatml_ids(self) -> Optional[List[int]]:
        ids = [self._added.get(IM_START), self._added.get(IM_END)]
        return None if None in ids else ids

    def token_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        if token_id in self._special:
            return b""
        piece = self._hf.id_to_token(token_id)
        if piece is None:  # an id the vocabulary skips
            return b""
        if piece in self._added:  # an added token that is not special: its string
            return piece.encode()
        if self._byte_level:
            return bytes(BYTE_OF_CHARACTER[c] for c in piece)
        byte = BYTE_PIECE.match(piece)
        return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()

    def byte_value(self, token_id: int) -> Optional[int]:
        """The byte of a byte-fallback piece (``<0x0A>``), or of a byte-level model's one-byte token."""
        if token_id in self._special:
            return None
        piece = self._hf.id_to_token(token_id) or ""
        if self._byte_level:
            return BYTE_OF_CHARACTER[piece] if len(piece) == 1 and piece not in self._added else None
        byte = BYTE_PIECE.match(piece)
        return int(byte[1], 16) if byte else None

    def id_to_piece(self, token_id: int) -> str:
        """A special token's string; a byte-level token's text (U+FFFD for part of a character);
        else the piece (``▁the``)."""
        self._check_id(token_id)
        if token_id in self._special:
            return self._special[token_id]
        if self._byte_level:
            return self.token_bytes(token_id).decode("utf-8", errors="replace")
        return self._hf.id_to_token(token_id)
