"""Prometheus metrics of the server, in a registry of its own (no global state).

Names follow Prometheus' conventions (``_total`` counters, ``_seconds`` histograms), under
the ``mixtral_infer_`` prefix; ``/metrics`` serves them in the text format.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Deque, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
RATE_WINDOW = 10.0  # seconds over which the tokens/s gauge is averaged


class ServeMetrics:
    def __init__(self, rows: int):
        self.registry = CollectorRegistry()
        prefix = "mixtral_infer_"
        r = self.registry
        self.rows = Gauge(prefix + "cache_rows", "Rows of the KV cache: sequences that can run at once", registry=r)
        self.rows.set(rows)
        self.queue_length = Gauge(prefix + "queue_length", "Requests waiting for a free row", registry=r)
        self.running = Gauge(prefix + "running_sequences", "Sequences holding a cache row", registry=r)
        self.tokens_per_second = Gauge(
            prefix + "generation_tokens_per_second", f"Generated tokens per second over the last {RATE_WINDOW:.0f} s",
            registry=r,
        )
        self.generated = Counter(prefix + "generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter(prefix + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.prefix_hits = Counter(
            prefix + "prefix_cache_hits", "Requests that started after prompt tokens already in a cache row", registry=r
        )
        self.prompt_reused = Counter(
            prefix + "prompt_tokens_reused", "Prompt tokens found in a cache row (a kept or copied prefix), not read again",
            registry=r,
        )
        self.prompt_prefilled = Counter(prefix + "prompt_tokens_prefilled", "Prompt tokens read by the model", registry=r)
        self.requests = Counter(prefix + "requests", "Finished requests by reason", ["finish_reason"], registry=r)
        self.rejected = Counter(prefix + "requests_rejected", "Requests refused (queue full or shutting down)", registry=r)
        self.time_to_first_token = Histogram(
            prefix + "time_to_first_token_seconds", "From arrival to the first generated token", buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            prefix + "request_latency_seconds", "From arrival to the last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            prefix + "queue_wait_seconds", "From arrival to taking a cache row", buckets=LATENCY_BUCKETS, registry=r
        )
        self.draft_tokens = Counter(
            prefix + "speculative_draft_tokens", "Guesses checked by speculative decoding's verify passes", registry=r
        )
        self.accepted_tokens = Counter(
            prefix + "speculative_accepted_tokens", "Guesses the model accepted (tokens gained)", registry=r
        )
        self.verify_row_steps = Counter(
            prefix + "speculative_row_steps", "Rows checked by verify passes, one per row and pass", registry=r
        )
        self.verify_tokens = Counter(
            prefix + "speculative_emitted_tokens", "Tokens the verify passes chose (accepted guesses, and one per row)", registry=r
        )
        self.acceptance_rate = Gauge(
            prefix + "speculative_acceptance_rate", "Accepted over checked guesses, since the server started", registry=r
        )
        self.tokens_per_step = Gauge(
            prefix + "speculative_tokens_per_step", "Tokens a row gains per verify pass, since the server started", registry=r
        )
        self._speculation = [0, 0, 0, 0]  # the counters above, summed here: guesses, accepted, emitted, row steps
        self._recent: Deque[Tuple[float, int]] = collections.deque()  # (time, tokens) of the last RATE_WINDOW s
        self._recent_total = 0  # the sum of their tokens, kept as they come and go
        self._lock = threading.Lock()

    # What the engine reports (in the engine's process, ``engine_process.RecordedMetrics`` records
    # these calls and this process replays them).

    def queue_waited(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def prompt_read(self, reused: int, prefilled: int) -> None:
        if reused:
            self.prefix_hits.inc()
            self.prompt_reused.inc(reused)
        self.prompt_prefilled.inc(prefilled)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def gauges(self, queued: int, running: int) -> None:
        self.queue_length.set(queued)
        self.running.set(running)

    def generated_tokens(self, n: int) -> None:
        self.generated.inc(n)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
            self._recent_total += n
            self._update_rate(now)

    def _update_rate(self, now: float) -> None:
        # A running total: summing the window on every call would cost O(tokens in the window) per
        # token, which slows a busy server down (docs/performance.md, "Serving").
        while self._recent and self._recent[0][0] < now - RATE_WINDOW:
            self._recent_total -= self._recent.popleft()[1]
        self.tokens_per_second.set(self._recent_total / RATE_WINDOW)

    def speculated(self, proposed: int, accepted: int, emitted: int, row_steps: int) -> None:
        """One verify pass: its guesses, those accepted, the tokens chosen and the rows it checked."""
        self.draft_tokens.inc(proposed)
        self.accepted_tokens.inc(accepted)
        self.verify_tokens.inc(emitted)
        self.verify_row_steps.inc(row_steps)
        totals = self._speculation = [a + b for a, b in zip(self._speculation, (proposed, accepted, emitted, row_steps))]
        self.acceptance_rate.set(totals[1] / totals[0] if totals[0] else 0.0)
        self.tokens_per_step.set(totals[2] / totals[3] if totals[3] else 0.0)

    def finished(self, reason: str, latency: float, prompt_tokens: int, completion_tokens: int) -> None:
        self.requests.labels(finish_reason=reason).inc()
        self.latency.observe(latency)
        self.prompt_tokens.inc(prompt_tokens)

    def exposition(self) -> bytes:
        with self._lock:
            self._update_rate(time.monotonic())
        return generate_latest(self.registry)
