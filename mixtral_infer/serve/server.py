"""``python main.py serve``: start the engine's process (it loads the model and sizes the rows:
``engine_process``), build the app over it, run uvicorn.

Shutdown (SIGTERM or Ctrl-C) drains, as a load balancer wants it: the server keeps accepting
connections, answers new generation requests 503 with ``Retry-After`` and ``/health`` 503
``draining``, while the requests already running or queued go on for up to ``shutdown_timeout``
seconds. When none is left, or at the timeout (those left are cancelled: their streams end with
``finish_reason: "abort"``), it closes the listener, lets the last responses finish and exits 0.
A second signal stops at once. No step on the way out depends on another succeeding: the log
lines come last and may fail (a log reader that has gone, ``serve 2>&1 | head``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from typing import Callable, Optional, Sequence

from mixtral_infer.errors import MixtralInferError
from mixtral_infer.tokenizer import Tokenizer

try:
    import uvicorn

    from mixtral_infer.serve.api import make_app
except ImportError as error:  # pragma: no cover - the serve extra is part of the test set-up
    raise MixtralInferError(f"serve needs the serve extra ({error.name} is missing): pip install -e '.[serve]'") from None

from mixtral_infer.serve.engine import Engine
from mixtral_infer.serve.engine_process import EngineProcess, Load, split_cpus
from mixtral_infer.serve.sizing import size
from mixtral_infer.generation.speculative import DEFAULT_SPECULATIVE_TOKENS

DEFAULT_MAX_MODEL_LEN = 32768  # serve's bound on a request of a windowed model whose folder declares none
FINAL_WRITES_S = 10.0  # after the drain, uvicorn's bound on the last responses' writes (cancelled streams' ends)


def cut(stats: dict) -> str:
    """How the model is cut across processes, for the log line (``Engine.stats``), or ""."""
    tensor, pipeline = stats.get("tensor_parallel", 1), stats.get("pipeline_ranks", 1)
    if tensor > 1:
        return f", the model cut across {tensor} processes by tensor parallelism"
    if pipeline > 1:
        return f", the model cut across {pipeline} processes in pipeline stages"
    return ""


def log_to_stderr(message: str) -> None:
    """A line on stderr. When its reader has gone (a dead log collector, ``serve 2>&1 | head``),
    stderr is pointed at /dev/null, so that no later write (a log line, uvicorn's, the
    interpreter's flush at exit) fails either: the server goes on, and stops when asked."""
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stderr.fileno())
            os.close(devnull)


class DrainingServer(uvicorn.Server):
    """uvicorn's server over ``app``, which drains before it stops (the module's docstring): the
    first signal starts the drain, ``on_tick`` (every 0.1 s) ends it when no request is left or at
    the timeout, and only then does uvicorn stop accepting. ``engine``: the app's (``drain``,
    ``cancel_all``, ``stats``)."""

    def __init__(self, app, engine: "EngineProcess | Engine", shutdown_timeout: float, log: Callable[[str], None] = log_to_stderr):
        # uvicorn's wait starts after the drain, by which time nothing is left running.
        super().__init__(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=FINAL_WRITES_S, lifespan="on"))
        self.engine, self.shutdown_timeout, self.log = engine, shutdown_timeout, log
        self.drain_until: Optional[float] = None  # time.monotonic() at which what is left is cancelled

    def handle_exit(self, sig: int, frame) -> None:
        """A signal handler: it must not raise, and each step is done whether the others fail."""
        if self.drain_until is not None:  # a second signal: cancel what is left and stop now
            with contextlib.suppress(Exception):
                self.engine.cancel_all()
            super().handle_exit(sig, frame)  # should_exit; a Ctrl-C after that: force_exit (uvicorn's)
            return
        self._captured_signals.append(sig)  # raised again once uvicorn has stopped, as uvicorn does
        self.drain_until = time.monotonic() + self.shutdown_timeout
        with contextlib.suppress(Exception):
            self.engine.drain()
        with contextlib.suppress(Exception):
            stats = self.engine.stats()
            self.log(
                f"stopping: {stats['running']} running and {stats['queued']} queued requests get up to "
                f"{self.shutdown_timeout:g}s to finish; new requests get 503 meanwhile"
            )

    async def on_tick(self, counter: int) -> bool:
        lost = getattr(self.engine, "lost", None)  # a rank of the model's process group broke: nothing can run
        if lost is not None and not self.should_exit:
            self.log(f"stopping: {lost}")
            self.should_exit = True
        if self.drain_until is not None and not self.should_exit:
            self.should_exit = self._drained()
        return await super().on_tick(counter)

    def _drained(self) -> bool:
        """Whether the drain is over: no request is being answered, or the time is up (what is
        left is cancelled: each stream then ends properly, finish_reason "abort" and [DONE])."""
        if time.monotonic() >= self.drain_until:
            with contextlib.suppress(Exception):
                self.engine.cancel_all()
            return True
        return not self.server_state.tasks


def engine_settings(
    prefill_tokens: int, max_model_len: Optional[int], decode: str, admit_every: Optional[int], prefix_reuse: bool, reuse_slack: int
) -> dict:
    """The ``Engine``'s options from the server's (every rank of a cut model builds its engine with them)."""
    return dict(
        prefill_tokens=prefill_tokens, max_model_len=max_model_len, decode=decode, admit_every=admit_every,
        prefix_reuse=prefix_reuse, slack=reuse_slack if prefix_reuse else 0,
    )  # fmt: skip


def follow_server(
    load: Load, *, prefill_tokens: int = 512, max_model_len: Optional[int] = None, decode: str = "auto",
    admit_every: Optional[int] = None, prefix_reuse: bool = True, reuse_slack: int = 0, collective_timeout: float = 120.0,
) -> None:  # fmt: skip
    """A rank other than 0 of a model cut across processes (``serve.step_group``): no HTTP; its share of
    every step, as rank 0's engine sends them, until rank 0 stops. The options are ``run_server``'s."""
    from mixtral_infer.serve.engine_process import run_follower

    settings = engine_settings(prefill_tokens, max_model_len, decode, admit_every, prefix_reuse, reuse_slack)
    run_follower(load, settings, collective_timeout)


def run_server(
    load: Load,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    adapters: Sequence[str] = (),
    host: str = "127.0.0.1",
    port: int = 8000,
    max_rows: Optional[int] = None,
    memory_fraction: Optional[float] = None,
    max_queue: int = 256,
    prefill_tokens: int = 512,
    max_model_len: Optional[int] = None,
    decode: str = "auto",
    admit_every: Optional[int] = None,
    shutdown_timeout: float = 30.0,
    pin_cpus: bool = False,
    prefix_reuse: bool = True,
    reuse_slack: int = 0,
    speculative_ngram: bool = False,
    speculative_tokens: Optional[int] = None,
    draft_load: Optional[Load] = None,
    collective_timeout: Optional[float] = None,
    log: Callable[[str], None] = log_to_stderr,
) -> None:
    """Serve until SIGTERM / SIGINT. Logs the rows and the address it listens on.

    ``load() -> (model, tokenizer)`` runs in the engine's own process (``engine_process``);
    this process keeps ``tokenizer`` for the requests' text. ``draft_load`` (a draft model, loaded
    there too) or ``speculative_ngram``: speculative decoding (``Engine``'s ``draft``). ``adapters``: the
    names of the adapters ``load`` keeps apart beside the model (``formats.adapters``), in its order.
    Under torchrun (``load`` joins the process group, ``serve.step_group``) this is rank 0: the engine
    process is rank 0 of the group, and ``collective_timeout`` the group's timeout; if the group breaks,
    the server stops and this raises why.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))  # before the model is loaded: a port in use is said at once
    except OSError as error:
        raise MixtralInferError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    cpus = split_cpus(sorted(os.sched_getaffinity(0))) if pin_cpus and hasattr(os, "sched_getaffinity") else None
    if pin_cpus and cpus is None:
        log("--pin-cpus: this process may use one CPU only (or the system cannot pin): nothing pinned")
    speculating = speculative_ngram or draft_load is not None
    k = (speculative_tokens or DEFAULT_SPECULATIVE_TOKENS) if speculating else 0
    engine = EngineProcess(
        load,
        plan=dict(
            prefill_tokens=prefill_tokens, max_rows=max_rows, memory_fraction=memory_fraction, max_model_len=max_model_len,
            slack=max(reuse_slack if prefix_reuse else 0, k),
        ),
        engine=dict(
            **engine_settings(prefill_tokens, max_model_len, decode, admit_every, prefix_reuse, reuse_slack),
            **({"draft": "ngram", "speculative_tokens": k} if speculative_ngram else {}),
            **({"draft_load": draft_load, "speculative_tokens": k} if draft_load is not None else {}),
        ),
        max_queue=max_queue, engine_cpus=cpus[1] if cpus is not None else None,
        **({"collective_timeout": collective_timeout} if collective_timeout is not None else {}),
    )
    if cpus is not None:
        os.sched_setaffinity(0, cpus[0])  # this thread, and the threads it starts from now on (uvicorn's, the reader)
        log(f"pinned: the server on CPU {cpus[0][0]}, the engine on CPU{'s' * (len(cpus[1]) > 1)} {','.join(map(str, cpus[1]))}")
    try:
        log(f"sizing: {engine.plan}")
        if prefix_reuse:
            log(
                f"prefix reuse: on, all {engine.rows} rows keep what they hold until a request needs the row "
                f"({size(engine.row_bytes)} a row, already counted in the rows: nothing more); a row steps back up to "
                f"{reuse_slack} tokens (--reuse-slack) for a regenerated answer or an edited last message; "
                "--no-prefix-reuse turns it off"
            )
        else:
            log("prefix reuse: off (--no-prefix-reuse), every prompt is read whole")
        if adapters:
            log(f"LoRA adapters kept apart: {', '.join(adapters)}, each a request's \"model\" (/v1/models); rows of "
                "different adapters decode in one batch, and a row's prefix is reused only by requests of its adapter")  # fmt: skip
        if speculating:
            what = "prompt lookup (--speculative-ngram)" if speculative_ngram else "a draft model (--draft-model)"
            log(f"speculative decoding: {what}, up to {k} guesses a step, at steps where every row decodes and where it "
                "gives more tokens a second (measured as it serves, per batch size); a request opts out with \"speculative\": false")  # fmt: skip
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
        address = f"http://{host}:{sock.getsockname()[1]}"

        def ready() -> None:
            log(
                f"serving {model_name} on {address} (decode {engine.mode}, {engine.rows} rows, queue {max_queue}, "
                f"{prefill_tokens} prefill tokens per step, at most {engine.max_model_len} tokens a request{cut(engine.stats())})"
            )

        app = make_app(engine, tokenizer, model_name, engine.metrics, on_ready=ready, adapters=adapters)
        server = DrainingServer(app, engine, shutdown_timeout, log)
        # uvicorn raises the signal that stopped it again once it has shut down; with this handler
        # in place that ends the process normally (exit 0) instead of by the signal.
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            server.run(sockets=[sock])
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        engine.kill()
    if engine.lost is not None:
        raise MixtralInferError(engine.lost)
    log("stopped")
