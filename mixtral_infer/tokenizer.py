"""A thin sentencepiece wrapper with the Mistral conventions (BOS prepended on request)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

from sentencepiece import SentencePieceProcessor

from mixtral_infer.errors import CheckpointError

LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class Tokenizer:
    def __init__(self, model_path: str | Path):
        path = Path(model_path)
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer file not found")
        self._model = SentencePieceProcessor()
        try:
            self._model.Load(str(path))
        except (OSError, RuntimeError) as error:
            raise CheckpointError(f"{path}: not a sentencepiece model ({error})") from None
        self.path = path

    @property
    def n_words(self) -> int:
        return self._model.vocab_size()

    @property
    def bos_id(self) -> int:
        return self._model.bos_id()

    @property
    def eos_id(self) -> int:
        return self._model.eos_id()

    @property
    def pad_id(self) -> int:
        return self._model.pad_id()

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        """Token ids of ``text``. Lone surrogates (undecodable input bytes) become U+FFFD."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._model.encode(LONE_SURROGATE.sub("\ufffd", text))
        if bos:
            ids = [self.bos_id] + ids
        if eos:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: List[int]) -> str:
        return self._model.decode(list(ids))

    def id_to_piece(self, token_id: int) -> str:
        return self._model.id_to_piece(token_id)
