"""A thin sentencepiece wrapper with the Mistral conventions (BOS prepended on request).

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
answer ends at ``<|im_end|>``, the next turn starts with ``\\n`` (``chatml``: the common ChatML
chat template's text, which transformers renders). Other fine-tunes' own templates are not run:
the instruct format is then Mistral's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from sentencepiece import SentencePieceProcessor

from mixtral_infer.errors import CheckpointError, GenerationError, as_int
from mixtral_infer.json_file import read_object
from mixtral_infer.shipped import resolve_model_folder

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.model.v3")  # looked for in this order
BEGIN_INST, END_INST = "[INST]", "[/INST]"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # ChatML's


def chatml(messages: List[tuple], generation_prompt: bool = True) -> str:
    """The ChatML text of ``(role, content)`` messages, as the common ChatML chat template renders
    it: each ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then ``<|im_start|>assistant\\n``."""
    text = "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages)
    return text + (f"{IM_START}assistant\n" if generation_prompt else "")


ADDED_TOKEN_FILES = ("tokenizer.json", "added_tokens.json")  # transformers' order
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # read before TOKENIZER_CONFIG, as transformers does


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
            alone = " (tokenizer.json alone is not read: the sentencepiece model is)" if (path.parent / "tokenizer.json").is_file() else ""
            raise CheckpointError(f"{path}: tokenizer file not found{alone}")
        self._model = SentencePieceProcessor()
        try:
            self._model.Load(str(path))
        except (OSError, RuntimeError) as error:
            raise CheckpointError(f"{path}: not a sentencepiece model ({error})") from None
        self.path = path
        self._instruct_ids = self.control_ids(BEGIN_INST, END_INST)
        self._pieces = self._model.vocab_size()
        self.added = {token.id: token for token in read_added_tokens(path.parent, self._pieces)}
        by_content = {token.content: token.id for token in self.added.values()}
        contents = sorted(by_content, key=len, reverse=True)  # the longest first, as one alternation
        self._split = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None
        self._by_content = by_content
        self._eos_id = self._end_token(path.parent)
        for name, token in (("BOS", self._model.bos_id()), ("EOS", self._eos_id)):
            if token < 0:  # sentencepiece trained with --bos_id=-1: encode() gave [-1, ...]
                raise CheckpointError(f"{path}: defines no {name} piece ({name.lower()}_id={token}): "
                                      "a Mistral model's prompts begin with <s> and its answers end with </s>")  # fmt: skip

    def _end_token(self, folder: Path) -> int:
        """The ``eos_token`` (a string, or ``{"content": ...}``) of ``special_tokens_map.json``, else of
        ``tokenizer_config.json`` (transformers' order), as an added token or a piece; else
        sentencepiece's end piece."""
        for config_path in (folder / SPECIAL_TOKENS_MAP, folder / TOKENIZER_CONFIG):
            eos = read_object(config_path, CheckpointError).get("eos_token") if config_path.is_file() else None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                break
        else:
            return self._model.eos_id()
        if eos in self._by_content:
            return self._by_content[eos]
        piece = self._model.piece_to_id(eos)
        if self._model.id_to_piece(piece) != eos:
            raise CheckpointError(
                f"{config_path}: eos_token {eos!r} is neither a piece of {self.path.name} nor an added token"
            )
        return piece

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        """The tokenizer of a model folder (a path or a shipped model's name, e.g. ``tiny-mixtral``)."""
        folder = resolve_model_folder(folder)
        path = find_tokenizer(folder)
        if path is None:
            raise CheckpointError(f"{Path(folder) / TOKENIZER_FILES[0]}: file not found (nor {', '.join(TOKENIZER_FILES[1:])})")
        return cls(path)

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

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        """Token ids of ``text``. Lone surrogates (undecodable input bytes) become U+FFFD."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        text = LONE_SURROGATE.sub("\ufffd", text)
        if self._split is None:
            ids = self._model.encode(text)
        else:  # added tokens' strings become their ids; each stretch between is encoded on its own
            parts = self._split.split(text)  # [text, token, text, token, ..., text]
            ids = [i for k, part in enumerate(parts) if part
                   for i in ([self._by_content[part]] if k % 2 else self._model.encode(part))]  # fmt: skip
        if bos:
            ids = [self.bos_id] + ids
        if eos:
            ids = ids + [self.eos_id]
        return ids

    @property
    def chat_format(self) -> str:
        """"chatml" for a ChatML fine-tune's tokens (module docstring), else ``version``."""
        return "chatml" if IM_START in self._by_content and IM_END in self._by_content else self.version

    def encode_instruct(self, text: str, follows_answer: bool = False) -> List[int]:
        """One user turn, without BOS, in this tokenizer's chat format (``follows_answer``: a turn
        after an answer, which ChatML starts on a new line).

        v1: the text ``[INST] {text} [/INST]``; v3: ``[INST]``, the pieces of ``text``, ``[/INST]``;
        chatml: the text ``<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n``.
        """
        if self.chat_format == "chatml":
            return self.encode(("\n" if follows_answer else "") + chatml([("user", text)]), bos=False)
        if self._instruct_ids is None:
            return self.encode(f"{BEGIN_INST} {text} {END_INST}", bos=False)
        begin, end = self._instruct_ids
        return [begin] + self.encode(text, bos=False) + [end]

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

    def id_to_piece(self, token_id: int) -> str:
        token = self.added.get(token_id)
        if token is not None:
            return token.content
        if not 0 <= token_id < self._pieces:  # sentencepiece's IndexError said only "OUT_OF_RANGE"
            raise GenerationError(f"token id {token_id} is outside this tokenizer's vocabulary [0, {self.n_words})")
        return self._model.id_to_piece(token_id)


def token_list(ids: object) -> List[int]:
    """``ids`` (a list, or a 1-D tensor or array) as Python ints; GenerationError for one id alone
    or for what is not an id (sentencepiece took ``True`` as 1 and raised its own TypeError for 1.5)."""
    if hasattr(ids, "tolist") and getattr(ids, "ndim", 1) == 1:  # a tensor or array
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise GenerationError(f"decode({ids!r:.40}): pass a list of token ids (one id: [id])")
    ids = list(ids)
    for token in ids:
        if type(token) is not int and as_int(token) is None:
            raise GenerationError(f"token id {token!r:.40} of type {type(token).__name__}: token ids must be integers")
    return [token if type(token) is int else as_int(token) for token in ids]
