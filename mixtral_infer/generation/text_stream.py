"""Tokens to text as they arrive: what the chat prints and the server streams, and where stop strings
are found in it.

``TextStream`` turns tokens into text pieces; ``StopStrings`` cuts those pieces at the first stop
string; ``AnswerText`` is the two together, one answer's text token by token. Used by
``generation.chat`` (the interactive loop), ``serve.engine`` (server-sent events) and
``generation.generate`` with its ``LLM`` (a row ends, and its text is cut, where the server's would).
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Sequence

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


class StopStrings:
    """Text released for streaming, cut at the first stop string; a tail that could be the start of
    one is held back, so streamed text never shows part of a stop string.

    ``stop = ["\\n\\n", "END"]``: pushing ``"a E"``, ``"N"``, ``"Db"`` releases ``"a "``
    (``"E"`` may start ``"END"``), then ``""``, then stops: the answer is ``"a "``.
    """

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.text = ""  # everything pushed, up to a stop string once found
        self.released = 0
        self.stopped = False

    def push(self, piece: str) -> str:
        """Text that may be shown now. After it returns with ``stopped`` set, push no more."""
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += piece
        found = self._first_stop(start)
        if found is not None:
            self.text, self.stopped = self.text[:found], True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        return self._release(len(self.text))

    def _first_stop(self, start: int) -> Optional[int]:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _release(self, end: int) -> str:
        end = max(end, self.released)
        piece, self.released = self.text[self.released : end], end
        return piece


class AnswerText:
    """One answer's text as its tokens arrive: ``TextStream``'s pieces through ``StopStrings``, as the
    server streams it (``serve.engine``). ``push`` gives the text that may be shown and sets ``stopped``
    once the text holds a stop string; ``finish`` gives the rest. A completion continues its prompt
    (``leading_space``): with ``stop=[" unto"]`` its first token ``▁unto`` stops it at once, though
    ``tokenizer.decode([▁unto])`` is ``"unto"``.
    """

    def __init__(self, tokenizer: Tokenizer, leading_space: bool, stop: Sequence[str] = ()):
        self.stream = TextStream(tokenizer, leading_space)
        self.stops = StopStrings(stop)

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    @property
    def text(self) -> str:
        """The text so far, cut before a stop string (held-back text included)."""
        return self.stops.text

    def push(self, token: int) -> str:
        return self.stops.push(self.stream.push(token))

    def finish(self) -> str:
        return self.stops.push(self.stream.finish()) + self.stops.flush()

    @classmethod
    def of(cls, tokenizer: Tokenizer, tokens: Sequence[int], leading_space: bool, stop: Sequence[str] = ()) -> "AnswerText":
        """The answer of these ``tokens``, pushed until one stops it, then finished: ``.text``, ``.stopped``."""
        answer = cls(tokenizer, leading_space, stop)
        for token in tokens:
            if answer.stopped:
                break
            answer.push(token)
        if not answer.stopped:
            answer.finish()
        return answer
