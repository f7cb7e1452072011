"""The serving engine in a process of its own (serve/engine_process.py): the same tokens as the
engine in this process, admission decided in the server's process, metrics replayed there, and
what happens when the engine process fails to load, dies, is sent signals, or loses its server.
"""

import functools
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import wait_for

from mixtral_infer import Tokenizer, load_model
from mixtral_infer.errors import CheckpointError, GenerationError, MixtralInferError
from mixtral_infer.serve.engine import Engine, Finished, QueueFull, RequestSettings, ShuttingDown, TokenEvent
from mixtral_infer.serve.engine_process import ENGINE_SWITCH_INTERVAL_S, EngineProcess, split_cpus

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[1]


def load_shipped(name: str):
    """Runs in the engine process, which is spawned: it must be importable by name."""
    torch.set_num_threads(1)
    return load_model(name, dtype=torch.float32, device="cpu"), Tokenizer.from_folder(name)


def failing_load():
    raise CheckpointError("consolidated.safetensors: not a safetensors file (header too short)")


def switch_interval_load():
    raise MixtralInferError(f"switch interval {sys.getswitchinterval()}")


def affinity_load():
    raise MixtralInferError(f"cpus {sorted(os.sched_getaffinity(0))} threads {torch.get_num_threads()}")


class Collector:
    """One request's events, and a flag set by its ``Finished``."""

    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, Finished):
            self.done.set()


def start(name: str = "tiny-mixtral", rows: int = 3, max_queue: int = 2) -> EngineProcess:
    engine = EngineProcess(
        functools.partial(load_shipped, name), plan=dict(prefill_tokens=16, max_rows=rows),
        engine=dict(prefill_tokens=16, decode="eager"), max_queue=max_queue,
    )  # fmt: skip
    engine.start()
    return engine


JOBS = [  # ragged prompts, greedy and seeded sampling, a stop string, logprobs
    ([1, 1029, 261, 1916, 1286], RequestSettings(max_tokens=9)),
    ([1] + list(range(300, 340)), RequestSettings(max_tokens=5, logprobs=2)),
    ([1, 7], RequestSettings(max_tokens=12, temperature=0.8, top_p=0.9, seed=5)),
    ([1, 1822, 285, 427], RequestSettings(max_tokens=20, stop=[" the"])),
    (list(range(100, 123)), RequestSettings(max_tokens=7, temperature=1.0, seed=11)),
]


def run_in_this_process(jobs):
    model, tokenizer = load_shipped("tiny-mixtral")
    engine = Engine(model, tokenizer, rows=3, prefill_tokens=16, decode="eager")
    collectors = [Collector() for _ in jobs]
    for (prompt, settings), collector in zip(jobs, collectors):
        engine.submit(prompt, settings, collector)
    while engine.step():
        pass
    return [c.events for c in collectors]


def test_the_engine_process_gives_the_tokens_of_the_engine_in_this_process():
    engine = start()
    try:
        collectors = [Collector() for _ in JOBS]
        for (prompt, settings), collector in zip(JOBS, collectors):
            engine.submit(prompt, settings, collector)
        assert all(c.done.wait(60) for c in collectors)
    finally:
        engine.shutdown()
    expected = run_in_this_process(JOBS)
    for got, want in zip((c.events for c in collectors), expected):
        assert [(type(e), getattr(e, "token", None), e.text) for e in got] == [
            (type(e), getattr(e, "token", None), e.text) for e in want
        ]
        for g, w in zip(got, want):  # the batches may group differently: float32 sums in another order
            if isinstance(w, TokenEvent) and w.logprob is not None:
                assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
                assert [t for t, _ in g.top_logprobs] == [t for t, _ in w.top_logprobs]
        assert (got[-1].reason, got[-1].completion_tokens) == (want[-1].reason, want[-1].completion_tokens)
    assert expected[3][-1].reason == "stop" and expected[1][0].logprob is not None  # the settings took effect
    assert not engine.process.is_alive() and engine.process.exitcode == 0


def test_admission_in_the_server_process_cancel_stats_and_metrics(capfd):
    engine = start(rows=3, max_queue=2)
    try:
        endless = RequestSettings(max_tokens=10**6, ignore_eos=True)
        collectors = [Collector() for _ in range(5)]
        handles = [engine.submit([1, 1029, 261], endless, c) for c in collectors]
        with pytest.raises(QueueFull, match="all 3 rows are busy and 2 requests are waiting"):
            engine.submit([1, 2], RequestSettings(max_tokens=2), Collector())
        with pytest.raises(GenerationError, match="outside the vocabulary"):
            engine.submit([1, 10**6], RequestSettings(max_tokens=2), Collector())
        assert wait_for(lambda: engine.stats()["running"] == 3 and engine.stats()["queued"] == 2)
        os.kill(engine.process.pid, signal.SIGINT)  # a Ctrl-C reaches the whole process group: ignored there
        os.kill(engine.process.pid, signal.SIGTERM)
        for handle in handles[3:] + handles[:3]:  # the waiting ones first: a freed row never admits them
            engine.cancel(handle)
        assert all(c.done.wait(30) for c in collectors)
        assert [c.events[-1].reason for c in collectors] == ["cancelled"] * 5
        assert sum(isinstance(e, TokenEvent) for c in collectors[:3] for e in c.events) > 0  # they had been decoding
        stats = engine.stats()
        assert (stats["rows_free"], stats["running"], stats["queued"], stats["admitted"]) == (3, 0, 0, 3)  # 2 never had a row
        exposition = engine.metrics.exposition().decode()
        assert 'mixtral_infer_requests_total{finish_reason="cancelled"} 5.0' in exposition
        assert "mixtral_infer_running_sequences 0.0" in exposition
        assert "mixtral_infer_queue_wait_seconds_count 3.0" in exposition

        def broken(event):
            raise RuntimeError("a listener's bug")

        engine.submit([1, 1029], RequestSettings(max_tokens=3), broken)  # its events reach nobody...
        done = Collector()
        engine.submit([1, 1029], RequestSettings(max_tokens=3), done)  # ...and stop no one else's
        assert done.done.wait(30) and done.events[-1].reason == "length"
        assert "a listener's bug" in capfd.readouterr().err
    finally:
        engine.shutdown()


def test_a_dead_engine_process_fails_what_is_outstanding_and_takes_no_more():
    engine = start("tiny-mistral", rows=1, max_queue=1)
    try:
        running, waiting = Collector(), Collector()
        engine.submit([1, 1029], RequestSettings(max_tokens=10**6, ignore_eos=True), running)
        engine.submit([1, 7], RequestSettings(max_tokens=3), waiting)
        assert wait_for(lambda: len(running.events) > 2)
        os.kill(engine.process.pid, signal.SIGKILL)
        assert running.done.wait(30) and waiting.done.wait(30)
        for collector, prompt_tokens in ((running, 2), (waiting, 2)):
            last = collector.events[-1]
            assert (last.reason, last.error, last.prompt_tokens) == ("error", "the engine process stopped", prompt_tokens)
        assert engine.draining
        with pytest.raises(ShuttingDown, match="the engine process has stopped"):
            engine.submit([1, 2], RequestSettings(max_tokens=2), Collector())
    finally:
        engine.shutdown(timeout=5)


def test_a_model_that_fails_to_load_is_one_error_and_no_process():
    with pytest.raises(MixtralInferError, match=r"^consolidated.safetensors: not a safetensors file \(header too short\)$") as caught:
        EngineProcess(failing_load, plan={}, engine={}, max_queue=1)
    assert not isinstance(caught.value, CheckpointError)  # the message crossed the process boundary, not the object


def test_the_engine_process_ends_when_its_server_is_killed():
    """The server process dies without a word (SIGKILL): the engine's end of the pipe closes, and
    the engine process exits instead of holding the model's memory."""
    script = (
        "import functools, sys, time\n"
        "from mixtral_infer.cli.commands import load\n"
        "from mixtral_infer.serve.engine_process import EngineProcess\n"
        "engine = EngineProcess(functools.partial(load, 'tiny-mistral', 1, 'cpu', 'float32'),\n"
        "                       plan=dict(max_rows=2, prefill_tokens=16), engine=dict(decode='eager'), max_queue=1)\n"
        "engine.start()\n"
        "print(engine.process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        engine_pid = int(server.stdout.readline())
        assert alive(engine_pid)
        server.kill()
        server.wait()
        assert wait_for(lambda: not alive(engine_pid))
    finally:
        server.kill()


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_engine_process_switches_threads_often():
    """Requests arriving mid-step are unpickled without waiting out Python's default 5 ms."""
    with pytest.raises(MixtralInferError, match=f"switch interval {ENGINE_SWITCH_INTERVAL_S}$"):
        EngineProcess(switch_interval_load, plan={}, engine={}, max_queue=1)


def test_split_cpus_docstring_example():
    assert split_cpus([0, 1]) == ([0], [1])
    assert split_cpus([2, 3, 5]) == ([2], [3, 5])
    assert split_cpus([4]) is None


def test_the_engine_process_pins_itself_and_its_threads_to_its_cpus(monkeypatch):
    """One CPU of the test's: the engine's process runs there alone, with one torch thread."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # more threads than CPUs: cut down to one
    cpu = sorted(os.sched_getaffinity(0))[-1]
    with pytest.raises(MixtralInferError, match=rf"^cpus \[{cpu}\] threads 1$"):
        EngineProcess(affinity_load, plan={}, engine={}, max_queue=1, engine_cpus=[cpu])
