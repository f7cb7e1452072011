"""The server's tokens/s gauge: a sliding 10-second window kept as a running total."""

from __future__ import annotations

import pytest

from mixtral_infer.serve import metrics as metrics_module
from mixtral_infer.serve.metrics import RATE_WINDOW, ServeMetrics


def test_tokens_per_second_counts_only_the_last_window(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(metrics_module.time, "monotonic", lambda: clock[0])
    metrics = ServeMetrics(rows=4)
    gauge = metrics.tokens_per_second

    def at(t, n):
        clock[0] = t
        metrics.generated_tokens(n)
        return gauge._value.get()

    assert RATE_WINDOW == 10.0
    assert at(0.0, 5) == pytest.approx(0.5)  # 5 tokens over 10 s
    assert at(4.0, 7) == pytest.approx(1.2)
    assert at(12.0, 1) == pytest.approx(0.8)  # the 5 of t=0 left the window: 7 + 1
    assert at(30.0, 0) == pytest.approx(0.0)  # everything left it
    assert metrics.generated._value.get() == 13  # the counter keeps every token
    clock[0] = 31.0
    assert b"mixtral_infer_generation_tokens_per_second 0.0" in metrics.exposition()
