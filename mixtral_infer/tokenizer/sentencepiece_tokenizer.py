"""The sentencepiece back-end: Mistral's ``tokenizer.model`` files, with the Mistral conventions
(BOS prepended on request).

Two versions of Mistral's sentencepiece tokenizers are read. **v1** (``tokenizer.model``:
Mistral 7B v0.1/v0.2, Mixtral 8x7B; 32,000 pieces) has no instruct tokens: a turn is the
text ``[INST] question [/INST]``. **v3** (``tokenizer.model.v3``: Mistral 7B v0.3, Mixtral
8x22B; 32,768 pieces) has ``[INST]`` and ``[/INST]`` as control pieces, which no text
encodes to: a turn is ``[INST]`` + the question's pieces + ``[/INST]``, as in
mistral-common. The version is read from the pieces, not from the file name.

**Added tokens.** Hugging Face fine-tunes often add tokens past the sentencepiece model's pieces
(ChatML's ``<|im_end|>`` and ``<|im_start|>`` as ids 32000 and 32001 of a 32,002-row model). They
are read from the files beside the tokenizer, as transformers reads them: ``tokenizer.json``'s
``added_tokens`` (else ``added_tokens.json``), and the end token from ``eos_token`` of
``special_tokens_map.json`` or ``tokenizer_config.json``. Text is split at their strings and each
piece between is encoded on its own; decoding leaves special ones out, as transformers'
``decode(..., skip_special_tokens=True)`` does. Example, pieces 0-1999 and ``{2000: <|im_end|>,
2001: <|im_start|>}``: ``"a<|im_end|>b"`` -> ``[▁a, 2000, ▁b]``, decoded ``"a b"``.

**ChatML.** A tokenizer that adds ``<|im_start|>`` and ``<|im_end|>`` is a ChatML fine-tune's
(``chat_format``): a turn is ``<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n``, the
answer ends at ``<|im_end|>``, the next turn starts with ``\\n`` (``generation.chat_template.chatml``: the common ChatML
chat template's text, which transformers renders). Other fine-tunes' own templates are not run:
the instruct format is then Mistral's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from sentencepiece import SentencePieceProcessor

from mixtral_infer.errors import CheckpointError, GenerationError
from mixtral_infer.json_file import read_object
from mixtral_infer.tokenizer.gguf_vocab import sentencepiece_proto
from mixtral_infer.tokenizer.base import BEGIN_INST, END_INST, IM_END, IM_START, Tokenizer, configured_token, token_list

ADDED_TOKEN_FILES = ("tokenizer.json", "added_tokens.json")  # transformers' order


@dataclass(frozen=True)
class AddedToken:
    id: int
    content: str
    special: bool


def read_added_tokens(folder: Path, first_id: int) -> List[AddedToken]:
    """The tokens a fine-tune added past the ``first_id`` pieces of its sentencepiece model, from
    the first of ``ADDED_TOKEN_FILES`` in ``folder``; their ids must follow the pieces without gaps.
    Entries below ``first_id`` (a converter's copies of the model's own control pieces) are not added."""
    for name in ADDED_TOKEN_FILES:
        path = folder / name
        if not path.is_file():
            continue
        data = read_object(path, CheckpointError)
        if name == "tokenizer.json":
            entries = data.get("added_tokens") or []
            if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
                raise CheckpointError(f"{path}: added_tokens must be a list of objects")
            tokens = [(e.get("id"), e.get("content"), e.get("special", True)) for e in entries]
        else:
            tokens = [(token_id, content, True) for content, token_id in data.items()]
        added = [t for t in tokens if not (type(t[0]) is int and t[0] < first_id)]
        added.sort(key=lambda t: (type(t[0]) is not int, t[0] if type(t[0]) is int else 0))  # ids in order, others last
        ids = [t[0] for t in added]
        if any(type(i) is not int for i in ids) or ids != list(range(first_id, first_id + len(ids))):
            raise CheckpointError(
                f"{path}: added token ids {ids[:8]} must follow the tokenizer's {first_id} pieces without gaps"
            )
        contents = [t[1] for t in added]
        if any(not isinstance(c, str) or not c for c in contents) or len(set(contents)) != len(contents):
            raise CheckpointError(f"{path}: each added token must be a distinct, non-empty string")
        return [AddedToken(i, c, bool(special)) for i, c, special in added]
    return []


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model and a fine-tune's added tokens (module docstring)."""

    kind = "sentencepiece"
    order = 2

    @classmethod
    def reads(cls, path: Path) -> bool:
        return True  # any other file: a sentencepiece model (its reader says which it is not)

    def __init__(self, model_path: str | Path):
        path = Path(model_path)
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer file not found")
        self._model = SentencePieceProcessor()
        gguf = path.suffix.lower() == ".gguf"  # llama.cpp's file: its vocabulary, from its metadata (gguf_vocab)
        try:
            if gguf:
                self._model.LoadFromSerializedProto(sentencepiece_proto(path))
            else:
                self._model.Load(str(path))
        except (OSError, RuntimeError) as error:
            raise CheckpointError(f"{path}: not a sentencepiece model ({error})") from None
        self.path = path
        self._instruct_ids = self.control_ids(BEGIN_INST, END_INST)
        self._pieces = self._model.vocab_size()
        self.added = {} if gguf else {token.id: token for token in read_added_tokens(path.parent, self._pieces)}
        by_content = {token.content: token.id for token in self.added.values()}
        contents = sorted(by_content, key=len, reverse=True)  # the longest first, as one alternation
        self._split = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None
        self._by_content = by_content
        self._eos_id = self._model.eos_id() if gguf else self._end_token(path.parent)
        self._mistral_common = None
        for name, token in (("BOS", self._model.bos_id()), ("EOS", self._eos_id)):
            if token < 0:  # sentencepiece trained with --bos_id=-1: encode() gave [-1, ...]
                raise CheckpointError(f"{path}: defines no {name} piece ({name.lower()}_id={token}): "
                                      "a Mistral model's prompts begin with <s> and its answers end with </s>")  # fmt: skip

    def _end_token(self, folder: Path) -> int:
        """The ``eos_token`` of ``special_tokens_map.json``, else of ``tokenizer_config.json``
        (``configured_token``), as an added token or a piece; else sentencepiece's end piece."""
        configured = configured_token(folder, "eos_token")
        if configured is None:
            return self._model.eos_id()
        config_path, eos = configured
        if eos in self._by_content:
            return self._by_content[eos]
        piece = self._model.piece_to_id(eos)
        if self._model.id_to_piece(piece) != eos:
            raise CheckpointError(
                f"{config_path}: eos_token {eos!r} is neither a piece of {self.path.name} nor an added token"
            )
        return piece

    def control_ids(self, *pieces: str) -> Optional[List[int]]:
        """The ids of these control pieces (``[INST]``, ``[TOOL_CALLS]``), or None unless each is one."""
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
        return self._pieces + len(self.added)

    @property
    def bos_id(self) -> int:
        return self._model.bos_id()

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def _encode(self, text: str) -> List[int]:
        if self._split is None:
            return self._model.encode(text)
        # added tokens' strings become their ids; each stretch between is encoded on its own
        parts = self._split.split(text)  # [text, token, text, token, ..., text]
        return [i for k, part in enumerate(parts) if part
                for i in ([self._by_content[part]] if k % 2 else self._model.encode(part))]  # fmt: skip

    def encode_continuation(self, text: str) -> List[int]:
        """Token ids of ``text`` where it continues other text, without the ``▁`` sentencepiece puts
        before a text: encoded after a newline, whose ids are then left out."""
        newline = self._model.encode("\n")
        ids = self.encode("\n" + text, bos=False)
        return ids[len(newline) :] if ids[: len(newline)] == newline else ids

    def chatml_ids(self) -> Optional[List[int]]:
        if IM_START in self._by_content and IM_END in self._by_content:
            return [self._by_content[IM_START], self._by_content[IM_END]]
        return None

    def mistral_common(self):
        """mistral-common's ``MistralTokenizer`` over the same file, for a v3 model (made once). The
        library tells versions apart by the file's name, so a v3 file named otherwise is linked as ``.v3``."""
        if self.version != "v3" or self.path.suffix.lower() == ".gguf":  # mistral-common reads files only
            return None
        if self._mistral_common is None:
            import tempfile

            from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

            source = self.path
            if not source.name.endswith(".v3"):
                linked = Path(tempfile.mkdtemp(prefix="mixtral_infer_tokenizer_")) / "tokenizer.model.v3"
                linked.symlink_to(source.resolve())
                source = linked
            self._mistral_common = MistralTokenizer.from_file(str(source))
        return self._mistral_common

    def decode(self, ids: List[int]) -> str:
        """The text of token ids: a list, or a 1-D tensor or array."""
        ids = token_list(ids)
        if self.added and any(isinstance(i, int) and self._pieces <= i < self.n_words for i in ids):
            return self._decode_with_added(ids)
        try:
            return self._model.decode(ids)
        except IndexError:  # sentencepiece's "piece id is out of range", without the id: name it
            n_words = self.n_words  # only here: a server decodes once per token per request
            outside = next((i for i in ids if isinstance(i, int) and not 0 <= i < n_words), None)
            if outside is None:
                raise
            raise GenerationError(f"token id {outside} is outside this tokenizer's vocabulary [0, {n_words})") from None

    def _decode_with_added(self, ids: List[int]) -> str:
        """Special added tokens left out of one decode of the rest (transformers' ``skip_special_tokens``);
        other added tokens' strings between decodes of the pieces around them."""
        parts: List[str] = []
        run: List[int] = []
        for i in ids:
            token = self.added.get(i) if isinstance(i, int) else None
            if token is None:
                run.append(i)
            elif not token.special:
                parts += [self.decode(run), token.content]
                run = []
        return "".join(parts + [self.decode(run)])

    def decode_continuation(self, ids: List[int]) -> str:
        """Tokens that continue a text: sentencepiece drops the space of a first ``▁word``
        piece at the start of a decode, which a continuation must keep.

        ``decode([▁the, ▁LORD]) == "the LORD"``, ``decode_continuation([▁the, ▁LORD]) == " the LORD"``.
        """
        ids = token_list(ids)
        text = self.decode(ids)
        if ids and self.id_to_piece(ids[0]).startswith("\u2581"):
            text = " " + text
        return text

    def is_control(self, token_id: int) -> bool:
        """Whether the id is a control piece (BOS, EOS, ``[INST]``, unknown) or a special added
        token: no text encodes to it, and decoding leaves it out."""
        token = self.added.get(token_id)
        if token is not None:
            return token.special
        return bool(self._model.IsControl(token_id) or self._model.IsUnknown(token_id))

    def byte_value(self, token_id: int) -> Optional[int]:
        """The byte a byte-fallback piece (``<0x0A>``) stands for, else None."""
        if token_id in self.added or not self._model.IsByte(token_id):
            return None
        return int(self._model.id_to_piece(token_id)[3:5], 16)

    def token_bytes(self, token_id: int) -> bytes:
        if self.is_control(token_id):
            return b""
        byte = self.byte_value(token_id)
        return bytes([byte]) if byte is not None else self.id_to_piece(token_id).replace("\u2581", " ").encode()

    def id_to_piece(self, token_id: int) -> str:
        token = self.added.get(token_id)
        if token is not None:
            return token.content
        if not 0 <= token_id < self._pieces:  # sentencepiece's IndexError said only "OUT_OF_RANGE"
            raise GenerationError(f"token id {token_id} is outside this tokenizer's vocabulary [0, {self.n_words})")
        return self._model.id_to_piece(token_id)
