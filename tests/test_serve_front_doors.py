"""What the server answers at its edges (issue 72): fields it does not know, paths and methods it
does not have, a max_tokens over the model's limit, and requests that arrive while it drains;
and that it stops on SIGTERM when its log's reader has gone.

Most tests serve an in-process engine over a tiny random model with ``DrainingServer`` (the
uvicorn server ``serve`` runs) on a thread; the drain is started by calling its signal handler.
One test runs ``main.py serve`` for real, with its stderr on a pipe nobody reads.
"""

import dataclasses
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import random_model, tiny_args, wait_for

from mixtral_infer import Tokenizer
from mixtral_infer.serve.api import make_app
from mixtral_infer.serve.engine import Engine
from mixtral_infer.serve.metrics import ServeMetrics
from mixtral_infer.serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS
from mixtral_infer.serve.server import DrainingServer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64  # tokens a request (--max-model-len) of the served engine
LONG = {"prompt": "module", "max_tokens": 30000, "ignore_eos": True}  # runs until cancelled


class Served:
    """An engine over a tiny random model, served by ``DrainingServer`` on a thread (real sockets).
    ``gate``: cleared, the engine waits after its next step until it is set again."""

    def __init__(self, tokenizer_path, max_model_len=None, shutdown_timeout=30.0, log=lambda message: None):
        self.gate = threading.Event()
        self.gate.set()
        self.tokenizer = Tokenizer(tokenizer_path)
        model = random_model(dataclasses.replace(tiny_args(), vocab_size=400))
        self.engine = Engine(model, self.tokenizer, rows=2, max_model_len=max_model_len, decode="eager", after_step=self.gate.wait)
        app = make_app(self.engine, self.tokenizer, "tiny", ServeMetrics(2))
        self.server = DrainingServer(app, self.engine, shutdown_timeout, log)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.server.started, 10)

    def request(self, method, path, body=None):
        """(status, headers, the JSON body) of one request on a connection of its own."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        connection.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
        connection.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(text)

    def open_stream(self, body):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        return connection, events(connection.getresponse())

    def stopped(self, timeout=10.0) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def close(self):
        self.gate.set()
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(10)
        self.engine.shutdown(cancel=True)


def events(response):
    """The JSON payloads of a server-sent event stream, then "[DONE]"."""
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: "):
            yield "[DONE]" if line == "data: [DONE]" else json.loads(line[len("data: ") :])


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture(scope="module")
def served(tokenizer_path):
    served = Served(tokenizer_path, max_model_len=LIMIT)
    yield served
    served.close()


CHAT = {"messages": [{"role": "user", "content": "module"}]}


@pytest.mark.parametrize(
    "path, body, param, message",
    [
        # were 200: 16 tokens (the default), and temperature 1
        ("/v1/completions", {"prompt": "hi", "max_token": 2}, "max_token", "unknown field 'max_token': did you mean 'max_tokens'?"),
        ("/v1/completions", {"prompt": "hi", "temprature": 0}, "temprature", "unknown field 'temprature': did you mean 'temperature'?"),
        ("/v1/completions", {"prompt": "hi", "max_completion_tokens": 2}, "max_completion_tokens", "did you mean 'max_tokens'?"),
        ("/v1/chat/completions", {**CHAT, "prompt": "hi"}, "prompt", "unknown field 'prompt': did you mean 'messages'?"),
        ("/v1/chat/completions", {**CHAT, "max_tokenz": 2}, "max_tokenz", "unknown field 'max_tokenz': did you mean 'max_tokens'?"),
        ("/v1/chat/completions", {**CHAT, "top_logprob": 2}, "top_logprob", "did you mean 'top_logprobs'?"),
        ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usuage": True}},
         "stream_options.include_usuage", "did you mean 'stream_options.include_usage'?"),  # fmt: skip
        ("/v1/completions", {"prompt": "hi", "zzz": 1, "max_token": 2}, "zzz",
         "unknown field 'zzz' (known: best_of, echo, frequency_penalty, "),  # fmt: skip
    ],
)
def test_unknown_fields_are_refused_naming_the_nearest_known_one(served, path, body, param, message):
    status, _, error = served.request("POST", path, body)
    assert status == 400, error
    assert error["error"]["param"] == param and error["error"]["code"] == "unknown_parameter"
    assert error["error"]["type"] == "invalid_request_error" and message in error["error"]["message"]
    if param == "zzz":  # every unknown field is named
        assert "; unknown field 'max_token': did you mean 'max_tokens'?" in error["error"]["message"]


def test_openai_s_fields_and_the_documented_extensions_are_still_taken(served):
    """vLLM's extensions that docs/serving.md lists, and OpenAI's fields that change nothing here."""
    completion = {"prompt": "module", "max_tokens": 3, "temperature": 0, "top_k": 5, "ignore_eos": True, "repetition_penalty": 1.1,
                  "min_tokens": 1, "user": "u", "seed": 1, "top_p": 0.9, "n": 1, "best_of": 1, "echo": False, "suffix": None,
                  "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "logprobs": None, "stop": None,
                  "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None}  # fmt: skip
    status, _, answer = served.request("POST", "/v1/completions", completion)
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    chat = {**CHAT, "max_completion_tokens": 2, "ignore_eos": True, "store": False, "metadata": {"a": "b"}, "user": "u",
            "parallel_tool_calls": True, "service_tier": "auto", "top_logprobs": 0, "logprobs": False}  # fmt: skip
    status, _, answer = served.request("POST", "/v1/chat/completions", chat)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2
    # Every field docs/serving.md names per request is one an endpoint knows.
    docs = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    per_request = docs[docs.index("Per request:") : docs.index("**Several answers.**")]
    named = {name for name in re.findall(r"`([a-z_]+)`", per_request)}
    assert named and named <= COMPLETION_FIELDS | CHAT_FIELDS, named - (COMPLETION_FIELDS | CHAT_FIELDS)


def test_unknown_paths_and_wrong_methods_answer_in_openai_s_shape(served):
    """They answered Starlette's {"detail": "Not Found"} and {"detail": "Method Not Allowed"}."""
    status, _, error = served.request("GET", "/v1/nothing")
    assert status == 404 and set(error) == {"error"}
    assert error["error"] == {"message": error["error"]["message"], "type": "not_found_error", "param": None, "code": None}
    assert error["error"]["message"].startswith("GET /v1/nothing: no such endpoint (this server has POST /v1/completions")
    status, headers, error = served.request("GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST" and set(error) == {"error"}
    assert error["error"]["message"] == "GET /v1/completions: method not allowed (this path takes POST)"
    assert error["error"]["type"] == "invalid_request_error"
    status, _, error = served.request("DELETE", "/health")
    assert status == 405 and "DELETE /health: method not allowed" in error["error"]["message"]


def test_a_failure_of_the_server_s_own_is_a_500_in_openai_s_shape(served, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(served.engine, "submit", broken)
    status, _, error = served.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 500 and error["error"]["type"] == "server_error"
    assert error["error"]["message"] == "the server failed on this request (RuntimeError): its log has the traceback"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, "max_tokens"),  # it named prompt
        ("/v1/completions", {"prompt": ["x", "module module"], "max_tokens": LIMIT - 2}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 10**9}, "max_tokens"),  # it named messages
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**9}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": list(range(3, 3 + LIMIT)), "max_tokens": 1}, "prompt"),  # the prompt alone fills the limit
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "module " * LIMIT}], "max_tokens": 1}, "messages"),
    ],
)
def test_a_request_over_the_model_s_limit_names_the_field_to_change(served, path, body, param):
    status, _, error = served.request("POST", path, body)
    assert status == 400 and error["error"]["param"] == param, error
    assert f"limit of {LIMIT} tokens per sequence" in error["error"]["message"]


def test_a_drain_answers_new_requests_503_while_running_ones_finish_then_stops(tokenizer_path):
    """The listener stays open during the drain (it closed at once: connection refused); the server
    stops by itself once the running request has finished, long before the timeout."""
    said = []
    served = Served(tokenizer_path, shutdown_timeout=30.0, log=said.append)
    try:
        served.gate.clear()  # the request stays running until the gate opens
        connection, running = served.open_stream({"prompt": "module", "max_tokens": 6, "ignore_eos": True})
        assert next(running)["choices"][0]["text"] == ""
        assert wait_for(lambda: served.engine.stats()["running"] == 1)
        started = time.monotonic()
        served.server.handle_exit(signal.SIGTERM, None)
        assert said == ["stopping: 1 running and 0 queued requests get up to 30s to finish; new requests get 503 meanwhile"]
        for path, body in [("/v1/completions", {"prompt": "x", "max_tokens": 2}), ("/v1/chat/completions", {**CHAT, "max_tokens": 2})]:
            status, headers, error = served.request("POST", path, body)
            assert status == 503 and headers["retry-after"] == "1", error
            assert error["error"]["type"] == "service_unavailable" and "shutting down" in error["error"]["message"]
        status, _, health = served.request("GET", "/health")
        assert status == 503 and health["status"] == "draining" and health["running"] == 1
        assert served.request("GET", "/v1/models")[0] == 200  # the rest still answers
        served.gate.set()
        finished = list(running)
        assert finished[-1] == "[DONE]" and finished[-2]["choices"][0]["finish_reason"] == "length"
        connection.close()
        assert served.stopped(10) and time.monotonic() - started < 10
        assert refuses_connections(served.port)
    finally:
        served.close()


def test_a_drain_cancels_what_runs_at_the_timeout_and_a_second_signal_stops_at_once(tokenizer_path):
    served = Served(tokenizer_path, shutdown_timeout=0.5)
    try:
        connection, running = served.open_stream(LONG)
        next(running)
        served.server.handle_exit(signal.SIGTERM, None)
        cut = list(running)  # cancelled at the timeout; the stream ends properly
        assert cut[-1] == "[DONE]" and cut[-2]["choices"][0]["finish_reason"] == "abort"
        connection.close()
        assert served.stopped(10)
    finally:
        served.close()
    served = Served(tokenizer_path, shutdown_timeout=30.0)
    try:
        connection, running = served.open_stream(LONG)
        next(running)
        served.server.handle_exit(signal.SIGTERM, None)
        assert served.request("POST", "/v1/completions", {"prompt": "x"})[0] == 503
        served.server.handle_exit(signal.SIGTERM, None)  # it changed nothing
        cut = list(running)  # cancelled now, not at the timeout
        assert cut[-1] == "[DONE]" and cut[-2]["choices"][0]["finish_reason"] == "abort"
        connection.close()
        assert served.stopped(10)
    finally:
        served.close()


def test_a_drain_does_not_depend_on_its_log_line(tokenizer_path):
    """The log line said first failed (its reader gone), and with it the rest of the shutdown."""

    def dead_log(message):
        raise BrokenPipeError(32, "Broken pipe")

    served = Served(tokenizer_path, shutdown_timeout=30.0, log=dead_log)
    try:
        served.server.handle_exit(signal.SIGTERM, None)
        assert served.stopped(10)
    finally:
        served.close()


def test_sigterm_stops_a_server_whose_log_reader_has_gone():
    """``main.py serve`` with stderr on a pipe whose reading end is closed (a dead log collector,
    ``serve 2>&1 | head``) ran on after SIGTERM, and after any later SIGTERM or SIGINT: its
    signal handler wrote a log line before it told uvicorn to stop, and the write failed. The one
    test here that starts the server for real (seconds: two processes import torch)."""
    command = [sys.executable, "main.py", "serve", "tiny-mistral", "--port", "0", "--max-rows", "1", "--decode", "static"]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = []
        for line in process.stderr:
            lines.append(line)
            if line.startswith("serving "):
                break
        found = re.search(r"http://127\.0\.0\.1:(\d+)", "".join(lines))
        assert found, "".join(lines)

        def healthy():
            connection = http.client.HTTPConnection("127.0.0.1", int(found.group(1)), timeout=30)
            connection.request("GET", "/health")
            return connection.getresponse().status == 200

        assert wait_for(healthy, 60)  # serving, not starting: its signal handler is uvicorn's
        process.stderr.close()  # the log's reader is gone
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
