"""When the serving engine speculates: at steps where every row decodes, while it pays on this machine.

A verify pass checks each row's last token and its guesses (``generation.speculative``): at batch 1
it reads the weights once for up to k + 1 tokens, nearly free. As the batch grows, a plain decode
step itself turns from reading weights into computing, and the k extra tokens a row cost their full
price, while the tokens a guess gains stay what the acceptance makes them. Where the two cross
depends on the machine, the model and the text, so the engine measures it as it serves
(``SpeculationPolicy``): per batch size (rounded up to a power of two), the seconds of plain decode
steps and of speculative steps (proposals and verify pass together), and the tokens a row gains per
speculative step. It speculates at a batch size while ``tokens per step * plain seconds > speculative
seconds`` (more tokens a second). Now and then it takes the other kind of step, so that both
measurements stay current as the traffic changes: after ``EXPLORE_FIRST`` steps of a bucket, then
twice as many each time the decision holds (up to ``EXPLORE_MOST``), ``EXPLORE_FIRST`` again once it
flips; a kind that does not pay then costs a fraction of a percent of the steps.

Worked example: at 16 rows a plain step takes 40 ms and a speculative one 90 ms with 2.0 tokens
a row per step: 2.0 * 40 = 80 < 90, plain steps (25 tokens a second per row against 22); at 1 row,
12 ms and 15 ms: 2.0 * 12 = 24 > 15, speculative steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

EXPLORE_FIRST = 32  # steps of a bucket before the kind not chosen is taken once, to keep its cost measured
EXPLORE_MOST = 1024  # the longest wait between two such steps, as a decision keeps holding
SMOOTHING = 0.2  # the weight of each new measurement in the running averages
UNMEASURED = float("inf")  # a kind of step taken once, not yet measured


def bucket(rows: int) -> int:
    """A batch size rounded up to a power of two: ``bucket(5) == 8``."""
    size = 1
    while size < rows:
        size *= 2
    return size


@dataclass
class SpeculationPolicy:
    """The measurements behind the choice (module docstring), per batch-size bucket."""

    plain: Dict[int, float] = field(default_factory=dict)  # seconds of a plain decode step
    speculative: Dict[int, float] = field(default_factory=dict)  # seconds of a speculative step
    gain: Dict[int, float] = field(default_factory=dict)  # tokens a row gains per speculative step
    seen: Dict[tuple, int] = field(default_factory=dict)  # measurements taken, per (kind, bucket)
    every: Dict[int, int] = field(default_factory=dict)  # steps between two of the other kind, per bucket
    since: Dict[int, int] = field(default_factory=dict)  # steps since the last of the other kind
    decided: Dict[int, bool] = field(default_factory=dict)  # the last decision, per bucket

    def wanted(self, rows: int) -> bool:
        """Whether this step, of ``rows`` decoding rows, speculates."""
        b = bucket(rows)
        if self.speculative.get(b, UNMEASURED) == UNMEASURED:
            return True  # measure it first
        if self.plain.get(b, UNMEASURED) == UNMEASURED:
            return False
        pays = self.pays(rows)
        if self.decided.get(b, pays) != pays:
            self.every[b] = EXPLORE_FIRST  # the decision flipped: look at the other kind often again
        self.decided[b] = pays
        self.since[b] = self.since.get(b, 0) + 1
        every = self.every.setdefault(b, EXPLORE_FIRST)
        if self.since[b] < every:
            return pays
        self.since[b] = 0
        self.every[b] = min(EXPLORE_MOST, 2 * every)
        return not pays

    def pays(self, rows: int) -> bool:
        """Whether speculating at ``rows`` rows gives more tokens a second, as measured so far."""
        b = bucket(rows)
        return self.gain[b] * self.plain[b] > self.speculative[b]

    def record_plain(self, rows: int, seconds: float) -> None:
        self._record(self.plain, "plain", rows, seconds)

    def record_speculative(self, rows: int, seconds: float, tokens_per_row: float) -> None:
        if self._record(self.speculative, "speculative", rows, seconds):
            self._average(self.gain, bucket(rows), tokens_per_row)

    def _record(self, table: Dict[int, float], kind: str, rows: int, seconds: float) -> bool:
        """Add a measurement; the first of each kind and bucket is left out (it may have built a step)."""
        key = (kind, bucket(rows))
        self.seen[key] = self.seen.get(key, 0) + 1
        if self.seen[key] == 1:
            table.setdefault(bucket(rows), UNMEASURED)  # measured at its next step
            return False
        self._average(table, bucket(rows), seconds)
        return True

    @staticmethod
    def _average(table: Dict[int, float], b: int, value: float) -> None:
        old = table.get(b)
        table[b] = value if old is None or old == UNMEASURED else (1 - SMOOTHING) * old + SMOOTHING * value

    def describe(self) -> Dict[str, dict]:
        """The measurements, for ``Engine.stats``."""
        return {f"{b} rows": {"plain_s": self.plain.get(b), "speculative_s": self.speculative.get(b), "gain": self.gain.get(b)}
                for b in sorted(set(self.plain) | set(self.speculative))}  # fmt: skip
