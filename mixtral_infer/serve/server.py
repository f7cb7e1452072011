"""``python main.py serve``: start the engine's process (it loads the model and sizes the rows:
``engine_process``), build the app over it, run uvicorn.

Shutdown (SIGTERM or Ctrl-C): the server stops accepting connections and the engine takes
no new requests (503 on connections still open); requests already running or queued go on
for up to ``shutdown_timeout`` seconds, then those left are cancelled (their streams end with
``finish_reason: "abort"``) and the process exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Callable, Optional

from mixtral_infer.errors import MixtralInferError
from mixtral_infer.tokenizer import Tokenizer

try:
    import uvicorn

    from mixtral_infer.serve.api import make_app
except ImportError as error:  # pragma: no cover - the serve extra is part of the test set-up
    raise MixtralInferError(f"serve needs the serve extra ({error.name} is missing): pip install -e '.[serve]'") from None

from mixtral_infer.serve.engine_process import EngineProcess, Load, split_cpus
from mixtral_infer.serve.sizing import size

DEFAULT_MAX_MODEL_LEN = 32768  # serve's bound on a request of a windowed model whose folder declares none


class _Server(uvicorn.Server):
    """uvicorn's server, which also tells the engine to take no new requests when asked to stop."""

    def __init__(self, config: uvicorn.Config, engine: EngineProcess, shutdown_timeout: float, log: Callable[[str], None]):
        super().__init__(config)
        self.engine, self.shutdown_timeout, self.log = engine, shutdown_timeout, log

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            stats = self.engine.stats()
            self.log(
                f"stopping: {stats['running']} running and {stats['queued']} queued requests get up to "
                f"{self.shutdown_timeout:g}s to finish"
            )
            # Cancel what is left just before uvicorn would cut the connections: each stream then
            # ends properly (finish_reason "abort", then [DONE]) and uvicorn exits at once.
            timer = threading.Timer(self.shutdown_timeout, self.engine.cancel_all)
            timer.daemon = True
            timer.start()
        self.engine.drain()
        super().handle_exit(sig, frame)


def run_server(
    load: Load,
    tokenizer: Tokenizer,
    *,
    model_name: str,
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
    log: Callable[[str], None] = lambda message: print(message, file=sys.stderr, flush=True),
) -> None:
    """Serve until SIGTERM / SIGINT. Logs the rows and the address it listens on.

    ``load() -> (model, tokenizer)`` runs in the engine's own process (``engine_process``);
    this process keeps ``tokenizer`` for the requests' text.
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
    engine = EngineProcess(
        load,
        plan=dict(prefill_tokens=prefill_tokens, max_rows=max_rows, memory_fraction=memory_fraction, max_model_len=max_model_len),
        engine=dict(
            prefill_tokens=prefill_tokens, max_model_len=max_model_len, decode=decode, admit_every=admit_every,
            prefix_reuse=prefix_reuse,
        ),
        max_queue=max_queue, engine_cpus=cpus[1] if cpus is not None else None,
    )
    if cpus is not None:
        os.sched_setaffinity(0, cpus[0])  # this thread, and the threads it starts from now on (uvicorn's, the reader)
        log(f"pinned: the server on CPU {cpus[0][0]}, the engine on CPU{'s' * (len(cpus[1]) > 1)} {','.join(map(str, cpus[1]))}")
    try:
        log(f"sizing: {engine.plan}")
        if prefix_reuse:
            log(
                f"prefix reuse: on, all {engine.rows} rows keep what they hold until a request needs the row "
                f"({size(engine.row_bytes)} a row, already counted in the rows: nothing more); --no-prefix-reuse turns it off"
            )
        else:
            log("prefix reuse: off (--no-prefix-reuse), every prompt is read whole")
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
        address = f"http://{host}:{sock.getsockname()[1]}"

        def ready() -> None:
            log(
                f"serving {model_name} on {address} (decode {engine.mode}, {engine.rows} rows, queue {max_queue}, "
                f"{prefill_tokens} prefill tokens per step, at most {engine.max_model_len} tokens a request)"
            )

        app = make_app(engine, tokenizer, model_name, engine.metrics, on_ready=ready)
        # uvicorn's own limit is a backstop: the engine cancels what is left at shutdown_timeout.
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout + 10, lifespan="on")
        server = _Server(config, engine, shutdown_timeout, log)
        # uvicorn raises the signal that stopped it again once it has shut down; with this handler
        # in place that ends the process normally (exit 0) instead of by the signal.
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            server.run(sockets=[sock])
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        engine.kill()
    log("stopped")
