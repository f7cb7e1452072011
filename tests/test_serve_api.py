"""The HTTP server on real sockets (127.0.0.1): the official openai client against `main.py serve`
run as a subprocess, greedy text equal to generate(); 32 concurrent streams; disconnect; a full
queue; bad requests; a prompt too long for a model without a window; SIGTERM.
"""

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import torch
from conftest import random_model, tiny_args, wait_for

from mixtral_infer import Tokenizer, generate, load_model
from mixtral_infer.generation.chat import Conversation
from mixtral_infer.serve.api import ChatFormat, CompletionFormat, sse

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "And the LORD spake unto Moses , saying , Speak unto the children of Israel , and say unto them , When any man "
    "of you bring an offering unto the LORD , ye shall bring your offering of the cattle , even of the herd , and of "
    "the flock ."
).split()


class Server:
    """``main.py serve`` in a subprocess; its stderr is collected in ``lines``."""

    def __init__(self, *args: str, model: str = "tiny-mixtral"):
        command = [sys.executable, "main.py", "serve", model, "--port", "0", "--dtype", "float32", *args]
        # One thread: the tests' own reference runs beside it on a 2-core machine.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
        self.lines = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(120):
            self.process.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines))
        self.port = int(re.search(r"http://127\.0\.0\.1:(\d+)", "".join(self.lines)).group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self):
        for line in self.process.stderr:
            self.lines.append(line)
            if line.startswith("serving "):
                self.ready.set()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def request(self, method: str, path: str, body=None, raw: bytes = None):
        """(status, headers, parsed JSON or text) of one plain HTTP request."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body) if body is not None else None)
        connection.request(method, path, data, {"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
        connection.close()
        is_json = response.getheader("content-type", "").startswith("application/json")
        return response.status, dict(response.getheaders()), json.loads(text) if is_json else text

    def open_stream(self, path: str, body: dict):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        connection.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        return connection, connection.getresponse()

    def health(self) -> dict:
        return self.request("GET", "/health")[2]

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def sse_events(response):
    """The JSON payloads of a server-sent event stream, then "[DONE]"."""
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: "):
            yield "[DONE]" if line == "data: [DONE]" else json.loads(line[len("data: ") :])


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread is faster, far faster on a busy machine


@pytest.fixture(scope="module")
def server():
    # 4 rows for 32 clients, prompts read 24 tokens per step: ragged prefill across steps and rows reused;
    # the engine's process and the server's on CPUs of their own.
    server = Server("--max-rows", "4", "--prefill-tokens", "24", "--max-queue", "64", "--pin-cpus")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference():
    model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
    return model, Tokenizer.from_folder("tiny-mixtral")


def solo_text(reference, prompt: str, max_tokens: int):
    model, tokenizer = reference
    generated, logprobs = generate(
        [tokenizer.encode(prompt)], model, max_tokens=max_tokens, eos_id=tokenizer.eos_id, prompt_logprobs=False
    )
    tokens = generated[0]
    space = " " if tokens and tokenizer.id_to_piece(tokens[0]).startswith("\u2581") else ""
    return space + tokenizer.decode(tokens), len(tokens), logprobs[0]


def test_completions_through_the_openai_client_equal_generate(server, reference):
    client = server.client()
    for prompt in ["In the beginning", " ".join(WORDS[:40])]:  # the second is longer than the window (32)
        expected, n_tokens, logprobs = solo_text(reference, prompt, 10)
        whole = client.completions.create(model="tiny-mixtral", prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
        assert whole.choices[0].text == expected
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == n_tokens == 10
        assert whole.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4)
        assert all(len(top) == 2 for top in whole.choices[0].logprobs.top_logprobs)
        chunks = list(client.completions.create(model="tiny-mixtral", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                                logprobs=1))  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "length"
        # Each token's text starts at its text_offset in the completion (it was []), streamed or whole.
        offsets = whole.choices[0].logprobs.text_offset
        streamed = [(c.choices[0].logprobs.text_offset[0], c.choices[0].text) for c in chunks if c.choices[0].logprobs]
        assert offsets == [offset for offset, _ in streamed] and offsets[0] == 0
        assert all(expected[offset:].startswith(text) for offset, text in streamed)
    assert [m.id for m in client.models.list().data] == ["tiny-mixtral"]


def test_chat_through_the_openai_client_equals_the_conversation(server, reference):
    model, tokenizer = reference
    client = server.client()
    question = "Who shall dwell in thy holy hill?"
    expected = Conversation(model, tokenizer, instruct=True, max_tokens=8, temperature=0.0).reply(question).text
    messages = [{"role": "user", "content": question}]
    whole = client.chat.completions.create(model="tiny-mixtral", messages=messages, max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny-mixtral", messages=messages, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    # A conversation: the earlier turns are in the prompt (in the instruct format).
    history = messages + [{"role": "assistant", "content": expected}, {"role": "user", "content": "And who shall stand?"}]
    again = client.chat.completions.create(model="tiny-mixtral", messages=history, max_tokens=4, temperature=0)
    conversation = Conversation(model, tokenizer, instruct=True, max_tokens=8, temperature=0.0)
    conversation.reply(question)
    conversation.params.max_tokens = 4
    assert again.choices[0].message.content == conversation.reply("And who shall stand?").text


def test_n_choices_of_a_list_of_prompts_as_openai_and_vllm_index_them(server, reference):
    """Two prompts, n=2, sampled with a seed: choice i of prompt p has index 2p + i and is the answer of
    that prompt alone with seed + i; the usage counts each prompt once and every answer; streamed,
    each index's text is its whole answer's."""
    model, tokenizer = reference
    client = server.client()
    prompts = ["In the beginning", "And the earth was without form"]
    whole = client.completions.create(model="tiny-mixtral", prompt=prompts, n=2, max_tokens=6, temperature=0.9, seed=3)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    for choice in whole.choices:
        ids = tokenizer.encode(prompts[choice.index // 2])
        generated, _ = generate([ids], model, max_tokens=6, temperature=0.9, seed=3 + choice.index % 2, eos_id=tokenizer.eos_id)
        space = " " if generated[0] and tokenizer.id_to_piece(generated[0][0]).startswith("\u2581") else ""
        assert choice.text == space + tokenizer.decode(generated[0])
    assert whole.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert whole.usage.completion_tokens == 4 * 6
    chunks = list(client.completions.create(model="tiny-mixtral", prompt=prompts, n=2, max_tokens=6, temperature=0.9, seed=3,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    texts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    chat = client.chat.completions.create(model="tiny-mixtral", messages=[{"role": "user", "content": "Who?"}], n=3,
                                          max_tokens=5, temperature=0)  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 1


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "count": {"type": "integer", "minimum": 0, "maximum": 9},
                   "kind": {"enum": ["a", "b"]}},  # fmt: skip
    "required": ["name", "count", "kind"],
    "additionalProperties": False,
}


def test_structured_output_through_the_openai_client(server):
    """The shipped model knows no JSON: a json_schema response format still returns text that parses
    and validates, whole and streamed; guided_choice answers one of the choices."""
    import jsonschema

    client = server.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Name a thing."}]
    for seed in range(3):
        whole = client.chat.completions.create(model="tiny-mixtral", messages=messages, max_tokens=200, temperature=1,
                                               seed=seed, response_format=response_format)  # fmt: skip
        assert whole.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
        chunks = list(client.chat.completions.create(model="tiny-mixtral", messages=messages, max_tokens=200, temperature=1,
                                                     seed=seed, response_format=response_format, stream=True))  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    choice = client.completions.create(model="tiny-mixtral", prompt="Yes or no?", max_tokens=10, temperature=1,
                                       extra_body={"guided_choice": ["yes", "no"]})  # fmt: skip
    assert choice.choices[0].text in ("yes", "no")


def test_tool_calls_through_the_openai_client(server):
    """tool_choice required: the answer is a call whose arguments validate (the text format of the
    shipped v1 tokenizer), whole and streamed as OpenAI's tool_calls deltas; its result goes back in
    the history as a tool message."""
    import jsonschema

    client = server.client()
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
                  "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": parameters}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs = dict(model="tiny-mixtral", messages=messages, tools=tools, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=60, temperature=1, seed=2)  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and len(call.id) == 9
    jsonschema.validate(json.loads(call.function.arguments), parameters)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [(0, "get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    history = messages + [whole.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "20 degrees"}]  # fmt: skip
    answer = client.chat.completions.create(model="tiny-mixtral", messages=history, tools=tools, max_tokens=5, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")


def prefix_counters(server) -> dict:
    metrics = server.request("GET", "/metrics")[2]
    names = ("prefix_cache_hits", "prompt_tokens_reused", "prompt_tokens_prefilled")
    return {name: float(re.search(rf"mixtral_infer_{name}_total ([\d.e+]+)", metrics).group(1)) for name in names}


def test_a_chat_s_next_turn_reads_only_its_new_tokens(server):
    """The second turn continues the row the first left (the prompt and the answer, which the template
    encodes back to the same ids here): /metrics counts the reused and the prefilled prompt tokens."""
    client = server.client()
    messages = [{"role": "user", "content": "Who shall dwell in thy holy hill?"}]
    first = client.chat.completions.create(model="tiny-mixtral", messages=messages, max_tokens=8, temperature=0)
    before = prefix_counters(server)
    history = messages + [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Why?"}]
    second = client.chat.completions.create(model="tiny-mixtral", messages=history, max_tokens=4, temperature=0)
    after = prefix_counters(server)
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"] + 1
    reused = after["prompt_tokens_reused"] - before["prompt_tokens_reused"]
    prefilled = after["prompt_tokens_prefilled"] - before["prompt_tokens_prefilled"]
    assert reused + prefilled == second.usage.prompt_tokens
    assert reused >= first.usage.prompt_tokens  # at least the first prompt; the answer too where it re-encodes alike


def test_32_concurrent_streams_each_get_their_solo_tokens(server, reference):
    """Ragged prompts (2..47 tokens, some past the window), staggered arrivals, 4 rows."""
    client = server.client()
    before = server.health()
    jobs = [(" ".join(WORDS[: 1 + (i * 7) % 40]), 3 + i % 6) for i in range(32)]
    results = [None] * len(jobs)

    def run(index):
        time.sleep(0.01 * index)
        prompt, max_tokens = jobs[index]
        stream = client.completions.create(
            model="tiny-mixtral", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        results[index] = (text, chunks[-1].usage.completion_tokens, [c.choices[0].finish_reason for c in chunks if c.choices][-1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for (prompt, max_tokens), result in zip(jobs, results):
        expected, n_tokens, _ = solo_text(reference, prompt, max_tokens)
        assert result == (expected, n_tokens, "length"), prompt
    after = server.health()
    assert after["admitted"] - before["admitted"] == 32 > after["rows"]  # every row was reused
    assert (after["rows_free"], after["running"], after["queued"]) == (4, 0, 0)  # nothing leaked
    metrics = server.request("GET", "/metrics")[2]
    assert "mixtral_infer_running_sequences 0.0" in metrics and "mixtral_infer_queue_length 0.0" in metrics
    assert re.search(r"mixtral_infer_time_to_first_token_seconds_count (\d+)", metrics)


def test_a_client_that_disconnects_frees_its_row(server):
    connection, response = server.open_stream("/v1/completions", {"prompt": "In the beginning", "max_tokens": 5000, "ignore_eos": True})
    events = sse_events(response)
    for _ in range(3):
        next(events)
    assert server.health()["running"] == 1
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    assert wait_for(lambda: server.health()["rows_free"] == 4)
    metrics = server.request("GET", "/metrics")[2]
    assert 'mixtral_infer_requests_total{finish_reason="cancelled"} 1.0' in metrics


def cancelled_requests(server) -> float:
    metrics = server.request("GET", "/metrics")[2]
    found = re.search(r'mixtral_infer_requests_total\{finish_reason="cancelled"\} ([\d.]+)', metrics)
    return float(found.group(1)) if found else 0.0


def test_a_client_that_leaves_before_its_whole_answer_frees_its_row(server):
    # Not streamed: the answer would come in one piece after 5000 tokens. The request produces a
    # token every step, so it must notice the client's leaving while tokens keep coming.
    before = cancelled_requests(server)
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": "In the beginning", "max_tokens": 5000, "ignore_eos": True}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    assert wait_for(lambda: server.health()["running"] == 1)
    time.sleep(0.5)  # tokens are being made
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    assert wait_for(lambda: server.health()["rows_free"] == 4)
    assert cancelled_requests(server) == before + 1


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature=-1 must be a number in [0, 2]"),
        ({"prompt": "x", "top_p": 0}, "top_p", "top_p=0 must be a number in (0, 1]"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens=0 must be an integer >= 1"),
        ({"prompt": "x", "n": 0}, "n", "n=0 must be an integer in [1, 128]"),
        # bounded by default: 32768 tokens a request for a windowed model whose folder declares no length
        ({"prompt": "x", "max_tokens": 10**9}, "max_tokens", "max_tokens=1000000000 exceeds this model's limit of 32768 tokens"),
        ({"prompt": ["x", "y"], "n": 65}, "prompt", "2 prompts times n=65 asks for more than 128 answers"),
        ({"prompt": ["x", [1, 99999]]}, "prompt", "prompt[1] holds token ids outside the vocabulary"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
        ({"prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
        ({"prompt": "x", "seed": -3}, "seed", "seed=-3 must be an integer in [0, 2**63)"),
        ({"prompt": "x", "logprobs": 9}, "logprobs", "logprobs=9 must be an integer in [0, 5]"),
        ({"prompt": "x", "suffix": "end"}, "suffix", "suffix='end': text after the completion (fill in the middle)"),
        ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options", "must be true or"),
        # true == 1 and false == 0 in Python: these passed as "n=1" and "no bias"
        ({"prompt": "x", "n": True}, "n", "n=True must be an integer in [1, 128]"),
        ({"prompt": "x", "best_of": 1.0}, "best_of", "best_of=1.0 is not supported"),
        ({"prompt": "x", "logit_bias": False}, "logit_bias", "logit_bias must be an object of token ids to numbers"),
        ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias", "'99999' is not a token id in [0, 2000)"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", "presence_penalty=3 must be a number in [-2, 2]"),
        ({"prompt": "x", "guided_regex": "[a-"}, "guided_regex", "guided_regex: the regex cannot be compiled"),
        ({"prompt": "x", "guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "give one of guided_json, guided_regex"),
        ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format", "must be an object with a schema"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ],
)
def test_bad_completion_requests_are_400s(server, body, param, message):
    status, _, error = server.request("POST", "/v1/completions", {"model": "tiny-mixtral", **body})
    assert status == 400
    assert error["error"]["param"] == param and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
    ],
)
def test_chat_fields_the_server_cannot_honour_are_refused_not_ignored(server, extra, param):
    body = {"model": "tiny-mixtral", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    status, _, error = server.request("POST", "/v1/chat/completions", {**body, **extra})
    assert status == 400 and error["error"]["param"] == param
    assert "is not supported by this server" in error["error"]["message"]
    # What asks for nothing is taken: no tools, plain text, the fields that change nothing here.
    harmless = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "store": False, "user": "u"}
    assert server.request("POST", "/v1/chat/completions", {**body, **harmless})[0] == 200


def test_a_chat_s_max_completion_tokens_and_max_tokens_are_each_checked(server):
    """A null max_completion_tokens hid max_tokens (the answer ran to the default length), and a bad
    max_tokens beside a good max_completion_tokens passed unchecked."""
    body = {"model": "tiny-mixtral", "messages": [{"role": "user", "content": "x"}], "temperature": 0, "ignore_eos": True}
    status, _, reply = server.request("POST", "/v1/chat/completions", {**body, "max_completion_tokens": None, "max_tokens": 2})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    for extra, param, message in [({"max_completion_tokens": 2, "max_tokens": "x"}, "max_tokens", "max_tokens='x' must be"),
                                  ({"max_completion_tokens": 2, "max_tokens": 3}, "max_completion_tokens", "disagree")]:  # fmt: skip
        status, _, error = server.request("POST", "/v1/chat/completions", {**body, **extra})
        assert status == 400 and error["error"]["param"] == param and message in error["error"]["message"]


def test_bad_requests_through_the_openai_client(server):
    client = server.client()
    status, _, error = server.request("POST", "/v1/completions", raw=b'{"prompt": "x"')
    assert status == 400 and "not valid JSON" in error["error"]["message"]
    for raw, why in [(b"[" * 100000 + b"]" * 100000, "nested too deeply"), (b'{"seed": ' + b"9" * 5000 + b"}", "4300 digits")]:
        status, _, error = server.request("POST", "/v1/completions", raw=raw)  # were RecursionError, ValueError
        assert status == 400 and "not valid JSON" in error["error"]["message"] and why in error["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="must alternate user, assistant"):
        client.chat.completions.create(model="tiny-mixtral", messages=[{"role": "assistant", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="serves 'tiny-mixtral'"):
        client.completions.create(model="gpt-4", prompt="x")
    assert server.health()["rows_free"] == 4


def test_full_queue_is_a_429_with_retry_after():
    server = Server("--max-rows", "1", "--max-queue", "1", "--decode", "static", "--no-prefix-reuse", model="tiny-mistral")  # not compiled: quicker
    try:
        assert "prefix reuse: off (--no-prefix-reuse), every prompt is read whole\n" in server.lines
        long = {"prompt": "In the beginning", "max_tokens": 5000, "ignore_eos": True}
        first, first_response = server.open_stream("/v1/completions", long)
        next(sse_events(first_response))
        assert wait_for(lambda: server.health()["running"] == 1)
        second, second_response = server.open_stream("/v1/completions", {"prompt": "Blessed are", "max_tokens": 3})
        assert wait_for(lambda: server.health()["queued"] == 1)
        status, headers, error = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 429 and headers["retry-after"] == "1"
        assert error["error"]["type"] == "rate_limit_error" and "1 requests are waiting" in error["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            server.client().completions.create(model="tiny-mistral", prompt="x", max_tokens=2)
        first.close()  # the first client leaves: the waiting request takes its row and completes
        events = list(sse_events(second_response))
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert wait_for(lambda: server.health()["rows_free"] == 1)
    finally:
        server.stop()


def test_sigterm_finishes_running_requests_then_cancels_at_the_timeout():
    server = Server("--max-rows", "2", "--shutdown-timeout", "5", "--decode", "static", model="tiny-mistral")
    try:
        short, short_response = server.open_stream("/v1/completions", {"prompt": "In the beginning", "max_tokens": 8, "ignore_eos": True})
        endless, endless_response = server.open_stream("/v1/completions", {"prompt": "Blessed are", "max_tokens": 30000, "ignore_eos": True})
        short_events, endless_events = sse_events(short_response), sse_events(endless_response)
        next(short_events), next(endless_events)
        server.process.send_signal(signal.SIGTERM)
        finished = list(short_events)
        assert finished[-1] == "[DONE]" and finished[-2]["choices"][0]["finish_reason"] == "length"
        try:  # a new request is refused: by the closed listener, or by the draining engine
            status, headers, _ = server.request("POST", "/v1/completions", {"prompt": "x"})
            assert status == 503 and headers["retry-after"] == "1"
        except (ConnectionError, http.client.HTTPException, OSError):
            pass
        cut = list(endless_events)  # cancelled at the timeout, and the stream ends properly
        assert cut[-1] == "[DONE]" and cut[-2]["choices"][0]["finish_reason"] == "abort"
        assert server.process.wait(30) == 0
        log = "".join(server.lines)
        assert re.search(r"stopping: \d running and \d queued requests get up to 5s to finish", log)
        assert log.rstrip().endswith("stopped") and "Traceback" not in log and "ERROR" not in log
    finally:
        server.stop()


def test_prompt_too_long_for_a_model_without_a_window(tmp_path, tokenizer_path):
    """In-process uvicorn on a real socket, over a random model without a sliding window."""
    import uvicorn

    from mixtral_infer.serve.api import make_app
    from mixtral_infer.serve.engine import Engine
    from mixtral_infer.serve.metrics import ServeMetrics

    args = tiny_args(sliding_window=None)
    args.vocab_size = 400
    tokenizer = Tokenizer(tokenizer_path)
    engine = Engine(random_model(args), tokenizer, rows=2, max_model_len=24, decode="eager")
    app = make_app(engine, tokenizer, "no-window", ServeMetrics(2))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: uvicorn_server.started)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="exceeds this model's limit of 24 tokens per sequence"):
            client.completions.create(model="no-window", prompt=list(range(3, 23)), max_tokens=8)
        # A chat without max_tokens runs to the limit: 24 tokens minus its prompt.
        answer = client.chat.completions.create(
            model="no-window", messages=[{"role": "user", "content": "module"}], temperature=0, extra_body={"ignore_eos": True}
        )
        assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 24
        assert answer.choices[0].finish_reason == "length"
        # A prompt that fills the limit: no max_tokens to blame (it said "plus max_tokens=1")
        with pytest.raises(openai.BadRequestError, match="the prompt .30 tokens. leaves no room for an answer within"):
            client.completions.create(model="no-window", prompt=list(range(3, 33)), max_tokens=8)
        with pytest.raises(openai.BadRequestError, match="leaves no room for an answer") as raised:
            client.chat.completions.create(model="no-window", messages=[{"role": "user", "content": "module " * 30}])
        assert raised.value.param == "messages"  # a chat's prompt is its messages (it said "prompt")
    finally:
        uvicorn_server.should_exit = True
        thread.join(10)


def test_serve_quantizes_while_loading_as_generate_does():
    """``serve --quantize int8``: the engine's process loads the model as ``load_model(quantize=)``
    does, and answers with its tokens; a folder stored quantized refuses a second --quantize."""
    model = load_model("tiny-mistral", dtype=torch.float32, device="cpu", quantize="int8")
    expected = solo_text((model, Tokenizer.from_folder("tiny-mistral")), "In the beginning", 10)[0]
    server = Server("--quantize", "int8", "--decode", "eager", "--max-rows", "2", model="tiny-mistral")
    try:
        assert "weights int8" in "".join(server.lines)
        client = server.client()
        answer = client.completions.create(model="tiny-mistral", prompt="In the beginning", max_tokens=10, temperature=0)
        assert answer.choices[0].text == expected
    finally:
        server.stop()
    from mixtral_infer.cli import commands

    assert commands.main(["serve", "--quantize", "int4-48"]) == 1  # checked before anything loads


def test_serve_options_are_checked_before_loading(capsys, monkeypatch):
    from mixtral_infer.cli import commands

    monkeypatch.setattr(commands, "load", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    assert commands.main(["serve", "--memory-fraction", "2"]) == 1
    assert capsys.readouterr().err.strip() == "error: --memory-fraction 2 must be a number in (0, 1]"
    assert commands.main(["serve", "--max-rows", "0"]) == 1
    assert capsys.readouterr().err.strip() == "error: --max-rows 0 must be an integer >= 1"
    assert commands.main(["serve", "--admit-every", "0"]) == 1
    assert capsys.readouterr().err.strip() == "error: --admit-every 0 must be an integer >= 1"
    assert commands.main(["serve", "--max_row", "4"]) == 2  # a usage error
    assert "did you mean --max-rows?" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", [CompletionFormat, ChatFormat])
def test_a_token_event_from_the_template_equals_the_encoded_chunk(fmt):
    """``text_sse`` encodes only the text; the event must be byte for byte ``sse(chunk(...))``."""
    formatted = fmt("tiny", Tokenizer.from_folder("tiny-mixtral"))
    for text in ["", " word", ' "quoted" \\ back', "\n\t", "é", "\u2028", "😀", "\ue000text\ue000"]:
        assert formatted.text_sse(text) == sse(formatted.chunk(text, None, None))


def test_the_server_says_how_it_pinned_its_processes_and_compiled_its_decode_step(server):
    """The default ``--decode auto`` on CPU: the decode step compiled before serving, and each step
    chooses it or the eager pass."""
    cpus = sorted(os.sched_getaffinity(0))
    said = "".join(server.lines)
    assert "compiling the decode step for 4 rows (once, before serving)...\n" in said
    assert re.search(r"\ncompiled in \d+\.\ds\n", said)
    assert re.search(r"\nserving tiny-mixtral on http://127\.0\.0\.1:\d+ \(decode compiled or eager, per step, 4 rows", said)
    assert "at most 32768 tokens a request)" in said
    assert re.search(r"\nprefix reuse: on, all 4 rows keep what they hold until a request needs the row \([\d.]+ MiB a row", said)
    if len(cpus) >= 2:
        rest = ",".join(map(str, cpus[1:]))
        assert f"pinned: the server on CPU {cpus[0]}, the engine on CPU{'s' * (len(cpus) > 2)} {rest}\n" in said
    else:
        assert "--pin-cpus: this process may use one CPU only" in said


def chromium_path():
    """Debian's chromium, driven by Playwright (no browser download): .ci/run installs both."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return None
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(chromium_path() is None, reason="no chromium and Playwright here (.ci/run installs Debian's chromium)")
def test_the_chat_page_streams_answers_keeps_the_conversation_and_shows_tokens_per_second(server):
    """GET / in a real headless browser: two turns typed into the page get the answers the API gives
    for the same conversation (greedy), and the page says each answer's tokens/s."""
    from playwright.sync_api import sync_playwright

    client = server.client()
    turns = ["Who shall dwell in thy holy hill?", "And who shall stand?"]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('model').textContent === 'tiny-mixtral'")
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "8")
            history = []
            for number, text in enumerate(turns, start=1):
                page.fill("#input", text)
                page.click("#send")
                page.wait_for_function(f"document.querySelectorAll('.assistant').length === {number} && "
                                       "document.getElementById('stats').textContent.includes('tokens/s')")  # fmt: skip
                history.append({"role": "user", "content": text})
                expected = client.chat.completions.create(model="tiny-mixtral", messages=history, max_tokens=8, temperature=0)
                answer = page.locator(".assistant").nth(number - 1).text_content()
                assert answer == expected.choices[0].message.content
                history.append({"role": "assistant", "content": answer})
                stats = page.text_content("#stats")
                assert re.match(rf"{expected.usage.completion_tokens} tokens, [\d.]+ tokens/s, first token after [\d.]+ s", stats), stats
            assert page.locator(".message").count() == 4
        finally:
            browser.close()
