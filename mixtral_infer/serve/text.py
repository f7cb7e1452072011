"""Stop strings on streamed text (the text itself comes from ``generation.text_stream``).

``StopStrings`` cuts the text at the first stop string and holds back a tail that could be
the start of one, so streamed text never shows part of a stop string.
"""

from __future__ import annotations

from typing import Optional, Sequence


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
