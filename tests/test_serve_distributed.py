"""``serve`` under torchrun (serve/step_group.py): a model cut across 2 CPU processes (gloo) answers as
one process does, streamed, batched, concurrent, structured, with tools and with n > 1; ``/health`` says
how it is cut; SIGTERM to rank 0 drains and stops every rank; a rank that hangs stops every process
with one line within the collective timeout."""

from __future__ import annotations

import concurrent.futures
import copy
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
import torch
from conftest import wait_for
from test_serve_api import SCHEMA, Server

from mixtral_infer import Tokenizer, load_model
from mixtral_infer.serve.engine import Engine, RequestSettings
from mixtral_infer.serve.step_group import EFFECTS, GroupLost

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ("--max-rows", "3", "--prefill-tokens", "16")


class RecordingGroup:
    """A ``StepGroup`` without processes: rank 0's effects recorded in order, rank 1's checks."""

    heartbeat_s = 1.0

    def __init__(self, rank: int):
        self.rank, self.sent, self.lost = rank, [], None

    def describe(self):
        return f"rank {self.rank} of 2"

    def send(self, name, args):
        self.sent.append((name, copy.deepcopy(args)))

    def lose(self, error):
        return GroupLost(f"lost: {error}")


def test_every_change_to_the_cache_is_an_effect_that_a_follower_replays_to_the_same_cache():
    """Rank 0's engine serves requests that wrap their windows, continue a row (prefix reuse, a step back
    through the slack), copy a row (n = 2), get cancelled, and a broken step clears every row; a second engine
    over the same weights that is given only the recorded effects, in order (``step_group.follow``), ends
    with the same cache, bit for bit, and rank 0's positions checked before every pass."""
    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    leader_group, follower_group = RecordingGroup(0), RecordingGroup(1)
    options = dict(prefill_tokens=7, decode="eager", slack=8)
    leader = Engine(model, tokenizer, 3, group=leader_group, **options)
    follower = Engine(model, tokenizer, 3, group=follower_group, **options)
    sink = lambda event: None  # noqa: E731
    conversation = tokenizer.encode("And the LORD spake unto Moses, saying, Speak unto the children of Israel")
    first = leader.submit(conversation, RequestSettings(max_tokens=20), sink)  # the row wraps its window of 32
    leader.submit(tokenizer.encode("In the beginning"), RequestSettings(max_tokens=30, temperature=0.9, seed=2), sink)
    while not first.done:
        leader.step()
    again = leader.submit(conversation + first.generated[:16], RequestSettings(max_tokens=6), sink)  # steps back 3 through the slack
    leader_of_two = leader.submit(tokenizer.encode("Blessed are"), RequestSettings(max_tokens=9, temperature=1.0, seed=5), sink)
    leader.submit(tokenizer.encode("Blessed are"), RequestSettings(max_tokens=9, temperature=1.0, seed=6), sink, follows=leader_of_two)
    cancelled = leader.submit(tokenizer.encode("Jesus wept."), RequestSettings(max_tokens=50), sink)
    for _ in range(3):
        leader.step()
    leader.cancel(cancelled)
    while leader.step():
        pass
    assert again.reused > 0 and leader.prefix_hits > 0
    leader.submit(tokenizer.encode("And it came to pass"), RequestSettings(max_tokens=9), sink)
    leader.step()
    leader._fail_all("a step that broke off")  # every row cleared, the cache no longer damaged
    leader.submit(tokenizer.encode("And it came to pass"), RequestSettings(max_tokens=4), sink)
    while leader.step():
        pass
    names = {name for name, _ in leader_group.sent}
    assert {"forward", "save", "clear_rows", "copy_row", "cut_back", "undamage"} <= names
    for name, args in leader_group.sent:
        getattr(follower, EFFECTS[name])(*args)
    assert follower.cache.tokens_seen == leader.cache.tokens_seen
    assert torch.equal(follower.cache.cache_k, leader.cache.cache_k) and torch.equal(follower.cache.cache_v, leader.cache.cache_v)
    assert follower.slack.saved == leader.slack.saved
    for mine, theirs in zip(follower.slack.keys + follower.slack.values, leader.slack.keys + leader.slack.values):
        assert torch.equal(mine, theirs)
    name, args = next((n, a) for n, a in leader_group.sent if n == "forward")
    with pytest.raises(GroupLost, match=r"rank 1 of 2: its cache is out of step with rank 0's"):
        getattr(follower, EFFECTS[name])(*args)  # the first pass again, over a cache that has moved on


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GroupServer(Server):
    """``torchrun --nproc-per-node 2 main.py serve tiny-mixtral ...``; rank 0 logs the address."""

    def __init__(self, *args: str, cut=("--tensor-parallel", "2"), timeout: float = 30.0):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "main.py", "serve", "tiny-mixtral", "--port", str(free_port()),
            "--dtype", "float32", *cut, "--collective-timeout", str(timeout), *args,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
        self.lines = []
        self.ready, self.ended = threading.Event(), threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(180):
            self.stop()
            raise RuntimeError("the group did not start:\n" + "".join(self.lines))
        self.port = int(re.search(r"http://127\.0\.0\.1:(\d+)", "".join(self.lines)).group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self):
        super()._read()
        self.ended.set()

    def ranks(self) -> dict:
        """{rank: pid} of torchrun's workers."""
        found = {}
        try:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        except OSError:  # torchrun has exited
            return found
        for pid in map(int, children):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:  # it has just exited
                continue
            rank = [e.split(b"=", 1)[1] for e in environ if e.startswith(b"RANK=")]
            if rank:
                found[int(rank[0])] = pid
        return found

    def stop(self):
        if self.process.poll() is None:
            for pid in self.ranks().values():
                with _gone():
                    os.kill(pid, signal.SIGCONT)
                    os.kill(pid, signal.SIGKILL)
            self.process.kill()
            self.process.wait()


class _gone:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is ProcessLookupError


@pytest.fixture(scope="module")
def servers():
    """The same options in one process and in two (tensor parallel)."""
    one = Server(*OPTIONS)
    try:
        two = GroupServer(*OPTIONS)
    except BaseException:
        one.stop()
        raise
    yield one, two
    two.stop()
    one.stop()


REQUESTS = [
    ("/v1/completions", {"prompt": "And the LORD spake unto Moses", "max_tokens": 16, "temperature": 0}),
    ("/v1/completions", {"prompt": "In the beginning", "max_tokens": 12, "temperature": 0.8, "seed": 4}),
    ("/v1/completions", {"prompt": "And God said", "max_tokens": 10, "temperature": 1.0, "seed": 9, "n": 2}),
    ("/v1/completions", {"prompt": "And the", "max_tokens": 8, "temperature": 0.7, "top_k": 20, "seed": 1,
                         "presence_penalty": 0.5, "frequency_penalty": 0.3}),  # fmt: skip
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a thing."}], "max_tokens": 120, "temperature": 1,
                              "seed": 2, "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}}),  # fmt: skip
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 60, "temperature": 1,
                              "seed": 3, "tool_choice": "required", "tools": [{"type": "function", "function": {
                                  "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                                                                         "required": ["city"], "additionalProperties": False}}}]}),  # fmt: skip
]


def answers(server, body: dict, path: str):
    """(whole answer's choices, the streamed text of each choice) without the ids and times."""
    status, _, whole = server.request("POST", path, {"model": "tiny-mixtral", **body})
    assert status == 200, whole
    connection, response = server.open_stream(path, {"model": "tiny-mixtral", **body})
    streamed: dict = {}
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: {"):
            for choice in json.loads(line[len("data: ") :])["choices"]:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                calls = (choice.get("delta") or {}).get("tool_calls") or []
                piece += "".join((c.get("function") or {}).get("arguments") or "" for c in calls)
                streamed[choice["index"]] = streamed.get(choice["index"], "") + piece
    connection.close()
    for choice in whole["choices"]:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call.pop("id", None)
    return whole["choices"], streamed


def test_two_processes_answer_as_one_whole_streamed_and_concurrent(servers):
    """Every request kind, all sent at once to each server (they share steps and rows), gives the same
    choices whole and the same text streamed, in 2 processes as in 1; /health says how it is cut."""
    one, two = servers
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS) * 2) as pool:
        futures = [(pool.submit(answers, one, body, path), pool.submit(answers, two, body, path)) for path, body in REQUESTS]
        for (path, body), (a, b) in zip(REQUESTS, futures):
            assert a.result(timeout=300) == b.result(timeout=300), body
    # A client that leaves mid-stream: its row is cleared on every rank, and the next answers are still one process's.
    connection, response = two.open_stream("/v1/completions", {"model": "tiny-mixtral", "prompt": "And", "max_tokens": 1000,
                                                              "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert response.readline().startswith(b"data: ")
    connection.close()
    assert wait_for(lambda: two.health()["running"] == 0, 60)
    path, body = REQUESTS[0]
    assert answers(one, body, path) == answers(two, body, path)
    health = two.health()
    assert (health["status"], health["tensor_parallel"], health["pipeline_ranks"]) == ("ok", 2, 1)
    assert (one.health()["tensor_parallel"], one.health()["pipeline_ranks"]) == (1, 1)
    assert any("the model cut across 2 processes by tensor parallelism" in line for line in two.lines)


def test_a_pipeline_of_two_answers_as_one_process_and_sigterm_to_rank_0_lets_a_stream_finish_then_stops_every_rank(servers):
    """A pipeline of two processes answers as one process does; then SIGTERM to its rank 0 while a stream
    runs: the stream finishes, and every rank stops (one group started for both: it costs seconds)."""
    one, _ = servers
    two = GroupServer(*OPTIONS, "--shutdown-timeout", "300", cut=("--num-pipeline-ranks", "2"))  # the drain must not cut the stream short on a busy machine
    try:
        for path, body in REQUESTS[:3]:
            assert answers(one, body, path) == answers(two, body, path)
        assert two.health()["pipeline_ranks"] == 2
        ranks = two.ranks()
        connection, response = two.open_stream("/v1/completions", {"model": "tiny-mixtral", "prompt": "And", "max_tokens": 300,
                                                                  "temperature": 0, "ignore_eos": True})  # fmt: skip
        first = response.readline()  # the stream has started
        assert first.startswith(b"data: ")
        os.kill(ranks[0], signal.SIGTERM)
        body = first + response.read()
        connection.close()
        assert b'"finish_reason":"length"' in body.replace(b" ", b"") and body.rstrip().endswith(b"data: [DONE]")
        assert two.process.wait(60) == 0  # torchrun: every rank exited 0
        assert any(line.startswith("stopping: ") for line in two.lines) and two.lines[-1].startswith("stopped")
    finally:
        two.stop()


def test_a_rank_that_hangs_stops_every_process_with_one_line_within_the_timeout():
    """Rank 1 stopped (SIGSTOP) while the server is idle: rank 0's heartbeat, a barrier, times out, and
    the server says so and exits; nothing waits forever."""
    timeout = 15.0
    server = GroupServer(*OPTIONS, timeout=timeout)
    try:
        os.kill(server.ranks()[1], signal.SIGSTOP)
        started = time.monotonic()
        said = "a process of the model's group died or hangs (rank 0 of 2 saw"
        assert wait_lines(server, lambda line: line.startswith(f"error: {said}"), 3 * timeout), server.lines
        assert time.monotonic() - started < 2 * timeout + 10  # the heartbeat (a quarter of it), the timeout, the stop
        assert any(line.startswith(f"stopping: {said}") for line in server.lines)
        assert wait_for(lambda: 0 not in server.ranks(), 30)  # rank 0 has exited
    finally:
        server.stop()


def wait_lines(server: GroupServer, found, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if any(found(line) for line in list(server.lines)):
            return True
        time.sleep(0.2)
    return False
