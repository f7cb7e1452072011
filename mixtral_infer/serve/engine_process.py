"""The serving engine in a process of its own, behind the ``Engine``'s interface.

Why a process: the engine's steps and the server's per-token work (a JSON chunk and a socket
write per token per client) are both Python, and in one process they take turns on one
interpreter lock, so together they use one core; in a process of its own the engine keeps
nearly all its speed behind HTTP (docs/performance.md, "Serving"). vLLM runs its engine core
apart from its API server for the same reason.

::

    server process (HTTP, JSON, SSE)                     engine process (the model)
    EngineProcess.submit -- ("submit", id, prompt, settings, follows) --> Engine.submit
    EngineProcess.cancel -- ("cancel", id) ---------------------> Engine.cancel
    reader thread <---- ("step", events, metric calls, stats) -- after every engine step

- **Admission happens in the server process**: it knows which requests are outstanding
  (submitted, no ``Finished`` yet), so a full queue (``QueueFull``) or a prompt that can never
  run (``GenerationError``) is refused without a round trip. The engine's own queue is unbounded.
- **One message per engine step** carries that step's events for all rows, so the pipe costs
  one write and one read per step, not one per token.
- **Metrics**: the engine's calls on its ``metrics`` are recorded in its process
  (``RecordedMetrics``) and replayed here on the ``ServeMetrics`` that ``/metrics`` shows.
- **Lifetime**: the engine process ignores SIGINT and SIGTERM (the server decides when to stop:
  it drains, then sends "shutdown"), and it exits when the pipe closes, so it never outlives
  the server. If it dies, every request still outstanding ends with an error and the engine
  reports ``draining`` (``/health`` answers 503).
- **A model cut across processes** (torchrun, ``serve.step_group``): this process is rank 0 of the
  group (it inherits torchrun's environment and joins as it loads); the other ranks run
  ``run_follower``. If the group breaks, the engine process sends ``("lost", why)`` and exits; the
  server says why and stops (``lost``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from mixtral_infer.errors import GenerationError, MixtralInferError
from mixtral_infer.serve.engine import Engine, Event, Finished, QueueFull, RequestSettings, ShuttingDown, check_request
from mixtral_infer.serve.metrics import ServeMetrics
from mixtral_infer.serve.sizing import plan_rows
from mixtral_infer.serve.step_group import DEFAULT_TIMEOUT_S, GroupLost, StepGroup, follow

Load = Callable[[], Tuple[Any, Any]]  # () -> (model, tokenizer), called in the engine process
# The engine process's thread switch interval (run_engine), a tenth of Python's default 5 ms so that
# requests reach the engine sooner (docs/performance.md, "Serving").
ENGINE_SWITCH_INTERVAL_S = 0.0005


class EngineProcess:
    """Starts the engine process, waits until its model is loaded and its rows planned, then
    stands for the ``Engine`` in the server: ``start``, ``submit``, ``cancel``, ``stats``,
    ``drain``, ``cancel_all``, ``shutdown``, and the attributes ``rows``, ``mode``,
    ``max_model_len``, ``draining``. ``metrics`` is the ``ServeMetrics`` it keeps up to date.

    ``load`` must be picklable (a module-level function, or a ``functools.partial`` of one):
    the process is spawned, not forked (a forked copy of a process that has run OpenMP or CUDA
    is not safe), so it loads the model itself. ``plan`` holds the keyword arguments of
    ``sizing.plan_rows``, ``engine`` those of ``Engine`` (not ``rows``). ``engine_cpus``: the
    CPUs the engine's process runs on (``split_cpus``), its torch threads at most as many.
    ``collective_timeout``: where ``load`` joins a process group (torchrun), its collectives' timeout.
    """

    def __init__(
        self, load: Load, *, plan: Dict[str, Any], engine: Dict[str, Any], max_queue: int,
        engine_cpus: Optional[List[int]] = None, collective_timeout: float = DEFAULT_TIMEOUT_S,
    ):  # fmt: skip
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.lost: Optional[str] = None  # why the process group broke (the engine process then exits)
        self.process = context.Process(
            target=run_engine, args=(child, load, plan, engine, engine_cpus, collective_timeout), name="mixtral_infer-engine",
            daemon=True,
        )  # fmt: skip
        self.process.start()
        child.close()
        atexit.register(self.kill)  # before multiprocessing's own exit handler, which would wait for it
        try:
            message = self.conn.recv()  # ("ready", info) once the model is loaded, or ("failed", why)
        except EOFError:
            self.kill()
            raise MixtralInferError(f"the engine process exited (code {self.process.exitcode}) while loading the model") from None
        except BaseException:
            self.kill()
            raise
        if message[0] == "failed":
            self.kill()
            raise MixtralInferError(message[1])
        info = message[1]
        self.rows: int = info["rows"]
        self.mode: str = info["mode"]
        self.max_model_len: Optional[int] = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.plan: str = info["plan"]
        self.row_bytes: int = info["row_bytes"]
        self._stats: Dict[str, int] = info["stats"]
        self.max_queue = max_queue
        self.metrics = ServeMetrics(self.rows)
        self.sinks: Dict[int, Tuple[Callable[[Event], None], int]] = {}  # outstanding: id -> (sink, prompt tokens)
        self.ids = itertools.count()
        self.lock = threading.Lock()  # guards sinks, draining and the pipe's sending end
        self.draining = False
        self.stopped = False  # the pipe from the engine process has closed: it has exited
        self.reader: Optional[threading.Thread] = None

    # ---- the Engine's interface ---------------------------------------------------------

    def start(self) -> None:
        self.reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self.reader.start()

    def submit(
        self, prompt: List[int], settings: RequestSettings, sink: Callable[[Event], None], follows: Optional[int] = None
    ) -> int:
        """Send a request to the engine; its handle is an id. Raises as ``Engine.submit`` does;
        ``follows``: the handle of an earlier request with the same prompt (``Engine.submit``)."""
        check_request(prompt, settings, self.vocab_size, self.max_model_len)
        with self.lock:
            if self.draining:
                raise ShuttingDown("the engine process has stopped" if self.stopped else "the server is shutting down")
            if len(self.sinks) >= self.rows + self.max_queue:
                raise QueueFull.of(self.rows, len(self.sinks) - self.rows)
            request_id = next(self.ids)
            self.sinks[request_id] = (sink, len(prompt))
            try:
                self.conn.send(("submit", request_id, list(prompt), settings, follows))
            except OSError:
                del self.sinks[request_id]
                raise ShuttingDown("the engine process has stopped") from None
        return request_id

    def cancel(self, request_id: int) -> None:
        with self.lock:
            if request_id in self.sinks:  # else it has finished: nothing to do
                self._send(("cancel", request_id))

    def stats(self) -> Dict[str, int]:
        """The engine's counts after its last step (``Engine.stats``)."""
        return dict(self._stats)

    def drain(self) -> None:
        """Take no new requests (refused here; the engine goes on with what it has)."""
        with self.lock:
            self.draining = True

    def cancel_all(self) -> None:
        with self.lock:
            self._send(("cancel_all",))

    def shutdown(self, cancel: bool = True, timeout: float = 30.0) -> None:
        """Stop the engine (cancelling what is left when ``cancel``) and wait for its process."""
        with self.lock:
            self.draining = True
            self._send(("shutdown", cancel))
        self.process.join(timeout)
        if self.reader is not None:
            self.reader.join(timeout)
        self.kill()

    def kill(self) -> None:
        """End the engine process now (it ignores SIGTERM) and close the pipe."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()

    # ---- the reader thread ----------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except OSError:  # the engine process is gone; the reader fails what is outstanding
            pass

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "stopped":
                break
            if message[0] == "lost":
                self.lost = message[1]
                continue
            _, events, calls, stats = message
            self._stats = stats
            for name, args in calls:
                getattr(self.metrics, name)(*args)
            deliveries = []
            with self.lock:
                for request_id, event in events:
                    entry = self.sinks.pop(request_id, None) if isinstance(event, Finished) else self.sinks.get(request_id)
                    if entry is not None:
                        deliveries.append((entry[0], event))
            for sink, event in deliveries:
                self._deliver(sink, event)
        with self.lock:
            left, self.sinks = self.sinks, {}
            self.draining = self.stopped = True
        for sink, prompt_tokens in left.values():
            self._deliver(sink, Finished("error", "", prompt_tokens, 0, error="the engine process stopped"))

    @staticmethod
    def _deliver(sink: Callable[[Event], None], event: Event) -> None:
        try:
            sink(event)
        except Exception:  # one broken listener must not stop the events of every other request
            traceback.print_exc()


# ---- the engine process ---------------------------------------------------------------------


class RecordedMetrics:
    """Stands for ``ServeMetrics`` in the engine process: each call the engine makes is
    recorded as ``(name, args)`` and replayed in the server process."""

    ENGINE_CALLS = frozenset({"queue_waited", "prompt_read", "first_token", "generated_tokens", "finished", "gauges", "speculated"})

    def __init__(self):
        self.calls: List[Tuple[str, tuple]] = []
        self.lock = threading.Lock()

    def __getattr__(self, name: str):
        if name not in RecordedMetrics.ENGINE_CALLS:
            raise AttributeError(name)

        def record(*args) -> None:
            with self.lock:
                self.calls.append((name, args))

        return record

    def take(self) -> List[Tuple[str, tuple]]:
        with self.lock:
            calls, self.calls = self.calls, []
        return calls


class Outbox:
    """The engine process's sending end: events and metric calls gathered during a step, sent
    as one message by ``flush`` (the engine's ``after_step``)."""

    def __init__(self, conn):
        self.conn = conn
        self.events: List[Tuple[int, Event]] = []
        self.metrics = RecordedMetrics()
        self.lock = threading.Lock()  # the engine's thread and the command loop both send
        self.engine: Optional[Engine] = None

    def sink(self, request_id: int, requests: Dict[int, Any]) -> Callable[[Event], None]:
        def put(event: Event) -> None:
            if isinstance(event, Finished):
                requests.pop(request_id, None)
            self.put(request_id, event)

        return put

    def put(self, request_id: int, event: Event) -> None:
        with self.lock:  # never into a list that flush has already taken
            self.events.append((request_id, event))

    def flush(self) -> None:
        with self.lock:
            events, self.events = self.events, []
            self.send(("step", events, self.metrics.take(), self.engine.stats()))

    def send(self, message: tuple) -> None:
        try:
            self.conn.send(message)
        except OSError:  # the server has gone; the command loop sees the pipe closed and stops
            pass


def split_cpus(cpus: Sequence[int]) -> Optional[Tuple[List[int], List[int]]]:
    """``(server's, engine's)`` CPUs for ``serve --pin-cpus``: the first for the server's process,
    the rest for the engine's; None for fewer than 2. ``split_cpus([0, 1]) == ([0], [1])``,
    ``split_cpus([2, 3, 5]) == ([2], [3, 5])``.

    Unpinned, the scheduler now and then runs the server's or the clients' threads on the
    engine's CPU, and the engine's step waits for them (docs/performance.md, "Serving").
    """
    cpus = list(cpus)
    return ([cpus[0]], cpus[1:]) if len(cpus) >= 2 else None


def run_engine(
    conn, load: Load, plan: Dict[str, Any], engine_options: Dict[str, Any], cpus: Optional[List[int]] = None,
    collective_timeout: float = DEFAULT_TIMEOUT_S,
) -> None:
    """The engine process: pin itself to ``cpus`` (if given), load, plan the rows, report ready,
    then run the engine's thread and take commands until "shutdown" or until the pipe closes. Where
    ``load`` joined a process group, this is rank 0: the rows it plans are every rank's, and its
    engine sends its effects to theirs (``step_group``)."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)  # before any thread starts: they inherit it
        torch.set_num_threads(min(torch.get_num_threads(), len(cpus)))  # two threads on one CPU wait on each other
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server handles it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Two threads here: the engine's, busy with steps, and this one, which unpickles each request
    # as it arrives. At Python's default 5 ms switch interval a request can wait that long for the
    # engine thread to let it go, and so miss the step that could admit it.
    sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
    outbox = Outbox(conn)
    group: Optional[StepGroup] = None
    agreed = False  # the other ranks have the rows (or were told there are none)
    try:
        model, tokenizer = load()
        if model.parallel.world_size > 1:
            group = StepGroup(collective_timeout)
        draft_load = engine_options.pop("draft_load", None)
        if draft_load is not None:  # a draft model for speculative decoding, loaded here beside the model
            draft, draft_tokenizer = draft_load()
            if draft_tokenizer.n_words != tokenizer.n_words:
                raise MixtralInferError(f"the draft model's tokenizer has {draft_tokenizer.n_words} tokens, the model's "
                                        f"{tokenizer.n_words}: a draft must share the model's tokenizer")  # fmt: skip
            engine_options = {**engine_options, "draft": draft}
        rows = plan_rows(model, **plan)
        if group is not None:
            agreed = True
            group.agree(rows.rows)  # every rank's engine gets as many rows
        engine = Engine(
            model, tokenizer, rows.rows, max_queue=sys.maxsize, metrics=outbox.metrics, after_step=outbox.flush,
            group=group, **engine_options,
        )  # fmt: skip
        if engine.mode == "compiled":  # compiled before the server says it is ready, not at the first request
            started = time.perf_counter()
            print(f"compiling the decode step for {rows.rows} rows (once, before serving)...", file=sys.stderr, flush=True)
            engine.warm_up()
            if engine.mode == "compiled":  # else it said why not (Engine._compile_failed)
                print(f"compiled in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
    except Exception as error:
        if not isinstance(error, MixtralInferError):
            traceback.print_exc()
        message = str(error) if isinstance(error, MixtralInferError) else f"{type(error).__name__}: {error}"
        if group is not None and not agreed:
            with contextlib.suppress(GroupLost):
                group.agree(None)  # the other ranks wait for the rows: none, they stop
        outbox.send(("failed", message))
        return
    outbox.engine = engine

    def lost(why: str) -> None:  # in the engine's thread, after it failed what was outstanding
        outbox.send(("lost", why))
        os._exit(1)

    engine.on_lost = lost
    info = {
        "rows": rows.rows, "mode": engine.describe_decode(), "max_model_len": engine.max_model_len,
        "vocab_size": model.args.vocab_size, "plan": rows.describe(), "stats": engine.stats(), "row_bytes": rows.row_bytes,
    }  # fmt: skip
    outbox.send(("ready", info))
    engine.start()
    requests: Dict[int, Any] = {}  # id -> the engine's Request, until it finishes
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server has gone
            message = ("shutdown", True)
        kind = message[0]
        if kind == "submit":
            _, request_id, prompt, settings, follows = message
            try:
                request = engine.submit(prompt, settings, outbox.sink(request_id, requests), follows=requests.get(follows))
            except GenerationError as error:  # checked by the server first; kept for safety
                outbox.put(request_id, Finished("error", "", len(prompt), 0, error=str(error)))
                outbox.flush()
                continue
            requests[request_id] = request
            if request.done:  # it finished before it was filed here: its sink found nothing to remove
                requests.pop(request_id, None)
        elif kind == "cancel":
            request = requests.get(message[1])
            if request is not None:
                engine.cancel(request)
        elif kind == "cancel_all":
            engine.cancel_all()
        elif kind == "shutdown":
            engine.shutdown(cancel=message[1])
            outbox.flush()
            outbox.send(("stopped",))
            return


def run_follower(load: Load, engine_options: Dict[str, Any], collective_timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """A rank other than 0 under torchrun (``serve.step_group``): load this rank's share, build the
    engine rank 0 builds, with the rows it planned, then apply rank 0's effects until it stops. Raises
    ``GroupLost`` when rank 0 dies, hangs or this rank goes out of step with it."""
    # torchrun signals every rank; rank 0 drains first, then tells the others to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    model, tokenizer = load()
    group = StepGroup(collective_timeout)
    rows = group.agree(None)
    if rows is None:  # rank 0 could not plan its rows (it says why)
        return
    engine = Engine(model, tokenizer, rows, max_queue=0, group=group, **engine_options)
    follow(engine, group)
