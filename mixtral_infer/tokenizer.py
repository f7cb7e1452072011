"""A thin sentencepiece wrapper with the Mistral conventions (BOS prepended on request).

Two versions of Mistral's sentencepiece tokenizers are read. **v1** (``tokenizer.model``:
Mistral 7B v0.1/v0.2, Mixtral 8x7B; 32,000 pieces) has no instruct tokens: a turn is the
text ``[INST] question [/INST]``. **v3** (``tokenizer.model.v3``: Mistral 7B v0.3, Mixtral
8x22B; 32,768 pieces) has ``[INST]`` and ``[/INST]`` as control pieces, which no text
encodes to: a turn is ``[INST]`` + the question's pieces + ``[/INST]``, as in
mistral-common. The version is read from the pieces, not from the file name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional

from sentencepiece import SentencePieceProcessor

from mixtral_infer.errors import CheckpointError, GenerationError
from mixtral_infer.shipped import resolve_model_folder

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.model.v3")  # looked for in this order
BEGIN_INST, END_INST = "[INST]", "[/INST]"


def find_tokenizer(folder: str | Path) -> Optional[Path]:
    """The tokenizer file of a model folder, or None."""
    for name in TOKENIZER_FILES:
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


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
        self._instruct_ids = self._control_ids(BEGIN_INST, END_INST)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        """The tokenizer of a model folder (a path or a shipped model's name, e.g. ``tiny-mixtral``)."""
        folder = resolve_model_folder(folder)
        path = find_tokenizer(folder)
        if path is None:
            raise CheckpointError(f"{Path(folder) / TOKENIZER_FILES[0]}: file not found (nor {', '.join(TOKENIZER_FILES[1:])})")
        return cls(path)

    def _control_ids(self, *pieces: str) -> Optional[List[int]]:
        ids = [self._model.piece_to_id(piece) for piece in pieces]
        if all(self._model.id_to_piece(i) == piece and self._model.IsControl(i) for i, piece in zip(ids, pieces)):
            return ids
        return None

    @property
    def version(self) -> str:
        """The instruct format: "v3" when [INST] and [/INST] are control pieces, else "v1"."""
        return "v3" if self._instruct_ids is not None else "v1"

    @property
    def n_words(self) -> int:
        return self._model.vocab_size()

    @property
    def bos_id(self) -> int:
        return self._model.bos_id()

    @property
    def eos_id(self) -> int:
        return self._model.eos_id()

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

    def encode_instruct(self, text: str) -> List[int]:
        """One user turn, without BOS, in the format this tokenizer's version expects.

        v1: the text ``[INST] {text} [/INST]``; v3: ``[INST]``, the pieces of ``text``, ``[/INST]``.
        """
        if self._instruct_ids is None:
            return self.encode(f"{BEGIN_INST} {text} {END_INST}", bos=False)
        begin, end = self._instruct_ids
        return [begin] + self.encode(text, bos=False) + [end]

    def decode(self, ids: List[int]) -> str:
        ids = list(ids)
        try:
            return self._model.decode(ids)
        except IndexError:  # sentencepiece's "piece id is out of range", without the id: name it
            n_words = self.n_words  # only here: a server decodes once per token per request
            outside = next((i for i in ids if isinstance(i, int) and not 0 <= i < n_words), None)
            if outside is None:
                raise
            raise GenerationError(f"token id {outside} is outside this tokenizer's vocabulary [0, {n_words})") from None

    def decode_continuation(self, ids: List[int]) -> str:
        """Tokens that continue a text: sentencepiece drops the space of a first ``▁word``
        piece at the start of a decode, which a continuation must keep.

        ``decode([▁the, ▁LORD]) == "the LORD"``, ``decode_continuation([▁the, ▁LORD]) == " the LORD"``.
        """
        text = self.decode(ids)
        if ids and self.id_to_piece(ids[0]).startswith("\u2581"):
            text = " " + text
        return text

    def id_to_piece(self, token_id: int) -> str:
        return self._model.id_to_piece(token_id)
