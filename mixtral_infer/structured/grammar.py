"""Constrained decoding: which tokens keep the text within a JSON schema, a regular expression, a
list of choices or a Lark grammar, computed by llguidance.

llguidance was chosen over xgrammar for its dependencies: none (a Rust library with a Python
binding), where xgrammar requires transformers, Triton and apache-tvm-ffi; both were measured on our
vocabularies (docs/performance.md, "Structured output").

How it works, for one row: a ``Constraint`` (what the client asked) is compiled once into a
grammar (``grammar_of``; a constraint llguidance cannot compile is a ``GenerationError`` of one
line, before any row is taken). A ``RowGrammar`` follows the row: before each token it writes the
allowed tokens as a bitmask, 32 tokens per int32 word (``fill``), the logits of the others become
-inf (``logits.apply_bitmask``), and the sampled token moves the grammar on (``accept``). When the
grammar is complete, EOS is the one token left (``done`` ends the row as EOS would).

The bridge to the tokenizer (``ll_tokenizer``): each token as the bytes it writes
(``Tokenizer.token_bytes``: sentencepiece's ``▁`` is a space and ``<0x0A>`` the byte 0x0A; a tekken
or byte-level ``tokenizer.json`` token its bytes, part of a character included), control tokens
marked special (they write no text), and an encoder that adds no leading space
(``Tokenizer.encode_continuation``), which llguidance calls for text it forces. Example, the
shipped tokenizer: piece ``▁the`` is ``b" the"``, ``<0x7B>`` is ``b"{"``, and a JSON schema allows
``{`` but no ``▁{`` as the first token (its text would begin with a space).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from mixtral_infer.errors import GenerationError
from mixtral_infer.tokenizer import Tokenizer

SPECIAL_MARK = b"\xff"  # llguidance's mark for a special token's bytes
KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


@dataclass(frozen=True)
class Constraint:
    """What the text of an answer must be: ``kind`` one of ``KINDS``, ``value`` its schema (a dict,
    or JSON text), expression, list of strings or grammar; ``json_object`` takes no value (any JSON
    object)."""

    kind: str
    value: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GenerationError(f"constraint kind {self.kind!r} must be one of {', '.join(KINDS)}")


def _import_llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency of the package
        raise GenerationError("structured output needs llguidance: pip install llguidance") from None
    return llguidance


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``; ``GenerationError`` when it cannot be compiled, in
    one line naming what to fix."""
    llg = _import_llguidance()
    kind, value = constraint.kind, constraint.value
    try:
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
        if kind == "json_schema":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict):
                raise GenerationError(f"the JSON schema must be an object, got {type(schema).__name__}")
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        if kind == "regex":
            if not isinstance(value, str) or not value:
                raise GenerationError("the regular expression must be a non-empty string")
            return llg.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
                raise GenerationError("the choices must be a non-empty list of non-empty strings")
            return llg.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in value))
        if not isinstance(value, str) or not value:
            raise GenerationError("the Lark grammar must be a non-empty string")
        return llg.LLMatcher.grammar_from_lark(value)
    except GenerationError:
        raise
    except (ValueError, TypeError) as error:  # llguidance's and json's errors: said in one line
        raise GenerationError(f"the {kind.replace('_', ' ')} cannot be compiled: {one_line(str(error))}") from None


def one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())[:300]


class _TokenizerBridge:
    """What llguidance's ``TokenizerWrapper`` reads of a tokenizer (module docstring)."""

    def __init__(self, tokenizer: Tokenizer):
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens: List[bytes] = []
        self.special_token_ids: List[int] = []
        for token_id in range(tokenizer.n_words):
            if tokenizer.is_control(token_id):
                self.tokens.append(SPECIAL_MARK + tokenizer.id_to_piece(token_id).encode())
                self.special_token_ids.append(token_id)
            else:
                self.tokens.append(tokenizer.token_bytes(token_id))
        self._tokenizer = tokenizer

    def __call__(self, text) -> List[int]:
        """Token ids of ``text`` as it continues other text (no leading space added)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode_continuation(text)


_LL_TOKENIZERS: Dict[int, Any] = {}


def ll_tokenizer(tokenizer: Tokenizer):
    """llguidance's tokenizer for ``tokenizer``, made once per tokenizer object."""
    made = _LL_TOKENIZERS.get(id(tokenizer))
    if made is None or made[0] is not tokenizer:
        llg = _import_llguidance()
        made = _LL_TOKENIZERS[id(tokenizer)] = (tokenizer, llg.LLTokenizer(llg.TokenizerWrapper(_TokenizerBridge(tokenizer))))
    return made[1]


def check_constraint(constraint: Constraint, tokenizer: Tokenizer) -> str:
    """The grammar of ``constraint``, checked against ``tokenizer``'s tokens; ``GenerationError`` if
    it cannot be compiled (a bad schema, a regular expression that cannot match)."""
    llg = _import_llguidance()
    grammar = grammar_of(constraint)
    error = llg.LLMatcher.validate_grammar(grammar, ll_tokenizer(tokenizer))
    if error:
        raise GenerationError(f"the {constraint.kind.replace('_', ' ')} cannot be compiled: {one_line(error)}")
    return grammar


class RowGrammar:
    """A grammar following one row's tokens (module docstring)."""

    def __init__(self, grammar: str, tokenizer: Tokenizer):
        llg = _import_llguidance()
        self.matcher = llg.LLMatcher(ll_tokenizer(tokenizer), grammar)
        if self.matcher.is_error():
            raise GenerationError(f"the constraint cannot be compiled: {one_line(self.matcher.get_error())}")

    def fill(self, bits: torch.Tensor) -> None:
        """Write the allowed next tokens into ``bits`` ``(ceil(V / 32),)`` int32, a contiguous CPU row."""
        self.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * bits.element_size())

    def accept(self, token: int) -> None:
        """Move on past the sampled ``token`` (one the mask allowed)."""
        if not self.matcher.consume_token(token):  # pragma: no cover - the mask allowed it
            raise GenerationError(f"token {token} does not continue the constrained text: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The text is complete and nothing may follow (the row ends as at EOS)."""
        return self.matcher.is_stopped()


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a row's bitmask: 32 tokens each."""
    return (vocab_size + 31) // 32


def fill_bitmask(grammars: Sequence[Optional[RowGrammar]], vocab_size: int) -> torch.Tensor:
    """``(N, ceil(V / 32))`` int32 bitmasks, every token allowed where a row has no grammar."""
    bits = torch.full((len(grammars), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.fill(bits[row])
    return bits
