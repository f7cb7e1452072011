"""Tokens to text as they arrive: what the chat prints and the server streams.

Used by ``generation.chat`` (the interactive loop) and ``serve.engine`` (server-sent events).
"""

from __future__ import annotations

import weakref
from typing import Dict, List

from mixtral_infer.tokenizer import Tokenizer

REPLACEMENT_CHARACTER = "\ufffd"  # what an incomplete UTF-8 byte sequence decodes to

# Per tokenizer, the text of each token decoded alone: a push decodes the last piece shown again,
# nearly always one token, so half of the tokenizer's calls become a dict lookup (a call goes
# through sentencepiece's Python wrapper, and a server makes one per token per request:
# docs/performance.md, "Serving").
_ONE_TOKEN_TEXT: "weakref.WeakKeyDictionary[object, Dict[int, str]]" = weakref.WeakKeyDictionary()


class TextStream:
    """Turns tokens into printable text pieces as they arrive, in time linear in the answer.

    Decoding token by token loses sentencepiece's spaces and splits multi-byte characters
    (byte-fallback pieces), so each new token is decoded together with the tokens since the
    last piece shown, ``tokens[start:]``, and the text beyond ``tokens[start:shown]``'s is
    emitted; it is held back while it ends in half a character. Both decodes start at the
    same token, so the space sentencepiece drops at the start of a decode drops from both.

    Worked example, pieces ``▁And ▁the <0xE4> <0xBD> <0xA0>`` (the last three are 你)::

        push ▁And    decode([▁And]) = "And"           emit " And" (the leading space, see below)
        push ▁the    [▁And ▁the] - [▁And]             emit " the"   start=1
        push <0xE4>  [▁the <0xE4>] ends in U+FFFD     hold
        push <0xBD>  [▁the <0xE4> <0xBD>]             hold
        push <0xA0>  [▁the 你] - [▁the]                emit "你"

    ``leading_space``: the answer continues a prompt, so a first piece starting with ``▁``
    shows its space (``Tokenizer.decode_continuation``).
    """

    def __init__(self, tokenizer: Tokenizer, leading_space: bool):
        self.tokenizer, self.leading_space = tokenizer, leading_space
        self.tokens: List[int] = []
        self.pieces: List[str] = []  # what was emitted
        self.start = 0  # decodes begin at this token: the first one of the last piece shown
        self.shown = 0  # tokens[:shown] are fully shown
        try:
            self._one_token_text = _ONE_TOKEN_TEXT.setdefault(tokenizer, {})
        except TypeError:  # a tokenizer that cannot be a weak key (unhashable): this stream's own cache
            self._one_token_text = {}

    def _decode(self, end: int) -> str:
        tokens = self.tokens[self.start : end]
        if self.start == 0 and self.leading_space:
            return self.tokenizer.decode_continuation(tokens)
        if len(tokens) == 1:  # usually the last piece shown, decoded again: the same text every time
            text = self._one_token_text.get(tokens[0])
            if text is None:
                text = self._one_token_text[tokens[0]] = self.tokenizer.decode(tokens)
            return text
        return self.tokenizer.decode(tokens)

    def push(self, token: int) -> str:
        """The new text after ``token`` ("" while the text ends in half a character)."""
        self.tokens.append(token)
        return self._show(final=False)

    def finish(self) -> str:
        """Whatever was held back (an answer may end in half a character, shown as U+FFFD)."""
        return self._show(final=True)

    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self.pieces)

    def _show(self, final: bool) -> str:
        before, now = self._decode(self.shown), self._decode(len(self.tokens))
        if len(now) <= len(before) or (not final and now.endswith(REPLACEMENT_CHARACTER)):
            return ""
        self.pieces.append(now[len(before) :])
        self.start, self.shown = self.shown, len(self.tokens)
        return self.pieces[-1]
