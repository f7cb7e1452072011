"""Tokens to streamed text: incremental detokenization and stop strings.

Decoding a sentencepiece token alone loses its leading space and may cut a multi-byte
character in half, and decoding the whole answer again for every token costs time
quadratic in its length. ``Detokenizer`` decodes a short window instead (as vLLM and TGI
do): the tokens from ``prefix`` on, minus the text those before ``read`` already gave. The
window's first token is decoded together with the tokens after it, so its space is kept.

``StopStrings`` cuts the text at the first stop string and holds back a tail that could be
the start of one, so streamed text never shows part of a stop string.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from mixtral_infer.tokenizer import Tokenizer

REPLACEMENT_CHARACTER = "\ufffd"  # what an incomplete UTF-8 byte sequence decodes to


class Detokenizer:
    """Text pieces of an answer, one call per token; their concatenation is the answer's text.

    ``leading_space``: a completion continues its prompt, so an answer whose first piece
    starts with a word boundary (``▁``) begins with a space, which ``decode`` drops.
    """

    def __init__(self, tokenizer: Tokenizer, leading_space: bool):
        self.tokenizer, self.leading_space = tokenizer, leading_space
        self.tokens: List[int] = []
        self.prefix = 0  # first token of the decode window
        self.read = 0  # tokens before this one have been turned into text

    def push(self, token: int) -> str:
        """The new text after ``token`` ("" while it ends in half a character)."""
        self.tokens.append(token)
        before, after = self._window()
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHARACTER):
            return ""
        return self._advance(after[len(before) :])

    def flush(self) -> str:
        """What is held back at the end of the answer (half a character, shown as U+FFFD)."""
        before, after = self._window()
        return self._advance(after[len(before) :]) if len(after) > len(before) else ""

    def _window(self) -> Tuple[str, str]:
        """The text of the window's tokens already read, and of all the window's tokens."""
        decode = self.tokenizer.decode
        return decode(self.tokens[self.prefix : self.read]), decode(self.tokens[self.prefix :])

    def _advance(self, piece: str) -> str:
        if self.read == 0 and self.leading_space and self.tokenizer.id_to_piece(self.tokens[0]).startswith("\u2581"):
            piece = " " + piece
        self.prefix, self.read = self.read, len(self.tokens)
        return piece


class StopStrings:
    """Text released for streaming, cut at the first stop string.

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
