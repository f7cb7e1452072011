"""The ``Tokenizer`` interface every back-end implements, and what they share.

``Tokenizer(path)`` opens a tokenizer file with the back-end its name calls for
(``BACKENDS``): ``tokenizer.model*`` with sentencepiece, ``*tekken*.json`` with mistral-common,
``tokenizer.json`` with Hugging Face's tokenizers; each back-end is a subclass, so
``isinstance(t, Tokenizer)`` holds for all of them and callers see one set of methods:

- ``encode(text, bos, eos)``, ``decode(ids)``, ``decode_continuation(ids)``;
- ``bos_id``, ``eos_id``, ``n_words``, ``version`` (the instruct format), ``chat_format``;
- per token: ``id_to_piece``, ``token_bytes`` (what it writes in a text), ``byte_value``,
  ``is_control`` (BOS, EOS, ``[INST]``: no text encodes to them, decoding leaves them out);
- ``control_ids(*pieces)``, ``chatml_ids()`` and ``mistral_common()`` (mistral-common's tokenizer
  over the same file, where it reads it): what ``generation.chat_template``, the one chat
  renderer, needs to write a conversation in the tokenizer's format.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import List, Optional, Tuple

from mixtral_infer.errors import CheckpointError, GenerationError, as_int
from mixtral_infer.json_file import read_object
from mixtral_infer.shipped import resolve_model_folder

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Looked for in this order: a folder with tokenizer.model and tokenizer.json (a fine-tune's added
# tokens) is read by sentencepiece; one with tekken.json and tokenizer.json (Mistral's hub folders)
# by mistral-common.
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.model.v3", "tekken.json", "tokenizer.json")
BEGIN_INST, END_INST = "[INST]", "[/INST]"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # ChatML's
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # read before TOKENIZER_CONFIG, as transformers does

def find_tokenizer(folder: str | Path) -> Optional[Path]:
    """The tokenizer file of a model folder (the first of ``TOKENIZER_FILES`` there), or None."""
    if str(folder).lower().endswith(".gguf") and Path(folder).is_file():  # llama.cpp's file holds its vocabulary
        return Path(folder)
    for name in TOKENIZER_FILES:
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


# The back-ends in the order they are asked whether they read a file (``Tokenizer.reads``); each
# registers itself when its class is defined, and ``tokenizer/__init__`` imports them all.
BACKENDS: List[type] = []


def backend_for(path: Path) -> type:
    """The ``Tokenizer`` subclass that reads ``path``: the first of ``BACKENDS`` whose ``reads``
    says yes (``tokenizer.json``; ``*tekken*.json``, mistral-common's test), else sentencepiece's,
    whose ``reads`` takes any other file."""
    for backend in BACKENDS:
        if backend.reads(path):
            return backend
    raise CheckpointError(f"{path}: no tokenizer back-end reads this file (import mixtral_infer.tokenizer first)")


@functools.lru_cache(maxsize=None)
def _joined(subclass: type, backend: type) -> type:
    """``subclass`` of ``Tokenizer`` (``class EndsThere(Tokenizer): eos_id = 7``) over ``backend``."""
    return type(subclass.__name__, (subclass, backend), {"__module__": subclass.__module__})


def configured_token(folder: Path, key: str) -> Optional[Tuple[Path, str]]:
    """``key`` (``"eos_token"``, ``"bos_token"``: a string, or ``{"content": ...}``) of
    ``special_tokens_map.json``, else of ``tokenizer_config.json`` (transformers' order), with the
    file it came from; None when neither names one."""
    for config_path in (folder / SPECIAL_TOKENS_MAP, folder / TOKENIZER_CONFIG):
        value = read_object(config_path, CheckpointError).get(key) if config_path.is_file() else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            return config_path, value
    return None


class Tokenizer:
    """Token ids and text for one model (module docstring); ``Tokenizer(path)`` is the back-end
    for the file. Back-ends implement the methods that raise ``NotImplementedError`` here."""

    kind = ""  # "sentencepiece", "tekken", "tokenizer.json"
    path: Path
    # Where a back-end sits in BACKENDS: the lower asked first (sentencepiece, reading any file, last).
    order = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.kind and "kind" in cls.__dict__:  # a back-end, not a subclass written over one
            BACKENDS.append(cls)
            BACKENDS.sort(key=lambda backend: backend.order)

    @classmethod
    def reads(cls, path: Path) -> bool:
        """Whether this back-end reads the file at ``path`` (by its name)."""
        raise NotImplementedError

    def __new__(cls, model_path: str | Path):
        if not cls.kind:  # Tokenizer, or a subclass written for any file: joined with the file's back-end
            cls = backend_for(Path(model_path)) if cls is Tokenizer else _joined(cls, backend_for(Path(model_path)))
        return super().__new__(cls)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        """The tokenizer of a model folder (a path or a shipped model's name, e.g. ``tiny-mixtral``)."""
        folder = resolve_model_folder(folder)
        path = find_tokenizer(folder)
        if path is None:
            raise CheckpointError(f"{Path(folder) / TOKENIZER_FILES[0]}: file not found (nor {', '.join(TOKENIZER_FILES[1:])})")
        return (Tokenizer if cls.kind else cls)(path)  # a subclass (bench_serve.FoldedTokenizer) keeps its methods

    # ---- what each back-end implements

    @property
    def n_words(self) -> int:
        raise NotImplementedError

    @property
    def bos_id(self) -> int:
        raise NotImplementedError

    @property
    def eos_id(self) -> int:
        raise NotImplementedError

    @property
    def version(self) -> str:
        """The instruct format: "v1" (``[INST]`` is text), "v3" (``[INST]`` and ``[/INST]`` are
        control tokens), or a tekken file's own ("v7": the system prompt in ``[SYSTEM_PROMPT]``...)."""
        raise NotImplementedError

    def _encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (a str without lone surrogates), without BOS or EOS."""
        raise NotImplementedError

    def decode(self, ids: List[int]) -> str:
        """The text of token ids (a list, or a 1-D tensor or array); control tokens write nothing."""
        raise NotImplementedError

    def control_ids(self, *pieces: str) -> Optional[List[int]]:
        """The ids of these control tokens (``[INST]``, ``[TOOL_CALLS]``), or None unless each is one."""
        raise NotImplementedError

    def is_control(self, token_id: int) -> bool:
        """Whether the id is a control token (BOS, EOS, ``[INST]``, unknown) or a special added
        token: no text encodes to it, and decoding leaves it out."""
        raise NotImplementedError

    def id_to_piece(self, token_id: int) -> str:
        """The token as the tokenizer names it: sentencepiece's ``▁the``, tekken's `` the``, a
        control token's ``[INST]``."""
        raise NotImplementedError

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token writes in a text (``▁the`` and tekken's `` the``: ``b" the"``; a byte
        token its byte; a control token ``b""``), what constrained decoding matches."""
        raise NotImplementedError

    # ---- shared

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        """Token ids of ``text``. Lone surrogates (undecodable input bytes) become U+FFFD. No text
        encodes to a control token: ``"[INST]"`` and ``"</s>"`` are their characters."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._encode(LONE_SURROGATE.sub("\ufffd", text))
        if bos:
            ids = [self.bos_id] + ids
        if eos:
            ids = ids + [self.eos_id]
        return ids

    def encode_continuation(self, text: str) -> List[int]:
        """Token ids of ``text`` where it continues other text: no space added before it (a
        byte-level tokenizer adds none; sentencepiece's back-end overrides this)."""
        return self.encode(text, bos=False)

    def decode_continuation(self, ids: List[int]) -> str:
        """Tokens that continue a text: sentencepiece drops the space of a first ``▁word`` piece at
        the start of a decode, which a continuation must keep; tekken keeps it already.

        ``decode([▁the, ▁LORD]) == "the LORD"``, ``decode_continuation([▁the, ▁LORD]) == " the LORD"``;
        tekken: ``decode([" unto"]) == decode_continuation([" unto"]) == " unto"``.
        """
        ids = token_list(ids)
        text = self.decode(ids)
        if ids and not text.startswith(" ") and self.token_bytes(ids[0]).startswith(b" "):
            text = " " + text
        return text

    def byte_value(self, token_id: int) -> Optional[int]:
        """The byte a byte token stands for (sentencepiece's ``<0x0A>``), else None."""
        return None

    def chatml_ids(self) -> Optional[List[int]]:
        """The ids of ChatML's ``<|im_start|>`` and ``<|im_end|>`` when both are tokens (a ChatML
        fine-tune's added tokens), else None."""
        return None

    @property
    def chat_format(self) -> str:
        """"chatml" for a ChatML fine-tune's tokens (``<|im_start|>``, ``<|im_end|>``), else ``version``."""
        return "chatml" if self.chatml_ids() is not None else self.version

    def mistral_common(self):
        """mistral-common's ``MistralTokenizer`` over the same file, where it reads it (tekken, and a
        v3 sentencepiece model), else None: ``generation.chat_template`` renders conversations with it."""
        return None

    def _outside(self, ids: List[int]) -> GenerationError:
        """The error for the first id of ``ids`` outside the vocabulary."""
        n_words = self.n_words
        outside = next(i for i in ids if not 0 <= i < n_words)
        return GenerationError(f"token id {outside} is outside this tokenizer's vocabulary [0, {n_words})")

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.n_words:
            raise self._outside([token_id])


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
