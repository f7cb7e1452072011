"""Answers that ``max_tokens`` cuts, and chat logprobs (issue 72, items 4 and 5): a forced list of
tool calls cut short answers with its complete calls as ``tool_calls`` (``finish_reason: length``),
whole and streamed; the ``token`` strings of a chat's logprobs make up ``message.content``, as
OpenAI's do, whole and streamed, with tools too. The server runs in this process (uvicorn on a real
socket) over the shipped tiny model, whose v1 tokenizer writes calls in the text format; the v3
control piece ``[TOOL_CALLS]`` is checked on the engine and the response bodies."""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import threading

import jsonschema
import pytest
import torch
from conftest import random_model, tiny_args, wait_for
from test_tools import TIME, WEATHER, tool_tokenizer, tool_tokenizer_path  # noqa: F401 (fixtures)

from mixtral_infer import Tokenizer, load_model
from mixtral_infer.serve.api import CallStream, ChatFormat, make_app
from mixtral_infer.serve.engine import Engine, RequestSettings, TokenEvent
from mixtral_infer.serve.metrics import ServeMetrics
from mixtral_infer.serve.protocol import chat_prompt
from mixtral_infer.serve.tools import call_grammar, check_tools, complete_calls, parse_calls

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


class InProcessServer:
    """``make_app`` over the tiny model's engine, served by uvicorn on a thread of this process."""

    def __init__(self):
        import uvicorn

        tokenizer = Tokenizer.from_folder("tiny-mixtral")
        model = load_model("tiny-mixtral", dtype=torch.float32, device="cpu")
        engine = Engine(model, tokenizer, rows=2, decode="eager")
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(make_app(engine, tokenizer, "tiny", ServeMetrics(2)), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        if not wait_for(lambda: self.server.started):
            raise RuntimeError("the in-process server did not start")

    def post(self, body: dict) -> dict:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        connection.request("POST", "/v1/chat/completions", json.dumps({"model": "tiny", **body}), {"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
        connection.close()
        assert response.status == 200, text
        return json.loads(text)

    def stream(self, body: dict) -> list:
        """The chunks of a streamed answer (its ``[DONE]`` checked and left out)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        connection.request("POST", "/v1/chat/completions", json.dumps({"model": "tiny", "stream": True, **body}),
                           {"Content-Type": "application/json"})  # fmt: skip
        response = connection.getresponse()
        assert response.status == 200
        lines = [line.decode().strip() for line in response]
        connection.close()
        payloads = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert payloads[-1] == "[DONE]"
        return [json.loads(p) for p in payloads[:-1]]

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    server = InProcessServer()
    yield server
    server.stop()


def check_calls(calls: list) -> None:
    """Each call names one of the tools and its arguments validate."""
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        assert call["type"] == "function" and len(call["id"]) == 9


def test_complete_calls_as_its_docstring_says():
    assert complete_calls(' [{"name": "a", "arguments": {}}, {"name": "b", "argu') == [{"name": "a", "arguments": {}}]
    assert complete_calls(' [{"name": "a", "arguments": {}}] and more') is None
    assert complete_calls('[{"name":"a","arguments":{}}, {"name":"b","arguments":{"x":1}}, ') == [
        {"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]  # fmt: skip
    assert complete_calls(' [{"name": "a", "argu') is None  # not one call complete
    assert complete_calls('{"name": "a"') is None  # not a list


def test_forced_calls_cut_by_max_tokens_are_the_complete_calls(server):
    """tool_choice required with OpenAI's default parallel_tool_calls: the greedy tiny model keeps
    adding calls until max_tokens cuts the third. The two complete ones are the answer (they were
    thrown away: the answer was the text "[TOOL_CALLS] [..." with no tool_calls)."""
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 120, "temperature": 0}
    whole = server.post(body)
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 120
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 2
    check_calls(calls)

    chunks = server.stream(body)
    deltas = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [(d["index"], d["function"]) for d in deltas] == [(i, c["function"]) for i, c in enumerate(calls)]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""  # no text: calls
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    # A list that max_tokens cuts inside its first call has no call to give: its text is the answer.
    short = server.post({**body, "max_tokens": 30})["choices"][0]
    assert short["finish_reason"] == "length" and short["message"]["content"].startswith("[TOOL_CALLS] [")
    assert "tool_calls" not in short["message"]


def test_a_v3_list_of_calls_cut_by_max_tokens_after_the_tool_calls_piece(tool_tokenizer):  # noqa: F811
    """The same with Mistral's [TOOL_CALLS] control piece (a v3 tokenizer, which decodes to no text),
    on the engine and the response bodies, whole and streamed; a cut list is no list of calls unless
    the answer was cut (``cut``)."""
    tokenizer = tool_tokenizer
    model = random_model(dataclasses.replace(tiny_args(moe=False), vocab_size=500), seed=3)
    functions, choice = check_tools([WEATHER, TIME], "required")
    prompt = chat_prompt(tokenizer, MESSAGES, functions)
    engine = Engine(model, tokenizer, rows=1, decode="eager")
    events = []
    settings = RequestSettings(max_tokens=60, temperature=0.0, leading_space=False, constraint=call_grammar(tokenizer, functions, choice))
    engine.submit(prompt, settings, events.append)
    while engine.step():
        pass
    *tokens, finished = events
    assert finished.reason == "length" and tokens[0].token == tokenizer.control_ids("[TOOL_CALLS]")[0]
    text = "".join(e.text for e in tokens) + finished.text
    assert parse_calls([e.token for e in tokens], text, tokenizer) is None  # not a whole list
    calls = parse_calls([e.token for e in tokens], text, tokenizer, cut=True)
    assert calls and len(calls) == text.count('"name"') - 1  # the last, unfinished, dropped
    check_calls(calls)

    fmt = ChatFormat("m", tokenizer).for_choice(0)
    fmt.calls = CallStream(tokenizer)
    whole = fmt.whole_choice(tokens, finished, with_logprobs=False)
    assert whole["finish_reason"] == "length" and [c["function"] for c in whole["message"]["tool_calls"]] == [c["function"] for c in calls]
    assert all(fmt.calls.push(e) == [] for e in tokens)  # streamed: held, it is a list of calls
    streamed, last = fmt.final_chunks(finished)
    assert [d["function"] for d in streamed["choices"][0]["delta"]["tool_calls"]] == [c["function"] for c in calls]
    assert last["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("tools", [None, "auto"])
def test_chat_logprobs_tokens_make_up_the_content(server, tools):
    """The first token's space, which a chat answer drops, is not in its token either (it was: the
    tokens began " " and the content did not); streamed, each chunk's logprobs come with its text,
    with tools too (they were sent for no token of an answer that might have been calls)."""
    body = {"messages": [{"role": "user", "content": "Who shall dwell in thy holy hill?"}], "max_tokens": 12,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    if tools:
        body.update(tools=[WEATHER], tool_choice=tools)
    (choice,) = server.post(body)["choices"]
    content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    assert len(entries) == 12 and not content.startswith(" ")
    assert "".join(t["token"] for t in entries) == content
    assert b"".join(bytes(t["bytes"]) for t in entries) == content.encode()
    assert all(len(t["top_logprobs"]) == 2 for t in entries)
    assert not entries[0]["top_logprobs"][0]["token"].startswith(" ")  # the first position's alternatives too

    chunks = server.stream(body)
    streamed = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == content
    assert [(t["token"], t["logprob"]) for t in streamed] == [(t["token"], t["logprob"]) for t in entries]


def test_a_character_in_byte_tokens_is_the_last_token_s_string():
    """``你`` is three byte tokens (after ``▁``): their strings are "", "", "你" and their bytes
    together its UTF-8, so that the strings and the bytes both make up the content (the strings
    were the names "<0xE4>"..., and so were the bytes)."""
    tokenizer = Tokenizer.from_folder("tiny-mixtral")
    ids = tokenizer.encode("Hello 你 there", bos=False)
    assert [tokenizer.id_to_piece(i) for i in ids[3:7]] == ["▁", "<0xE4>", "<0xBD>", "<0xA0>"]
    events = [TokenEvent(token, "", logprob=-1.0, top_logprobs=[(token, -1.0)]) for token in ids]
    entries = ChatFormat("m", tokenizer).logprobs(events)["content"]
    content = tokenizer.decode(ids)  # a chat answer's text: no leading space
    assert [t["token"] for t in entries] == ["H", "ell", "o", " ", "", "", "你", " there"]
    assert "".join(t["token"] for t in entries) == content
    assert b"".join(bytes(t["bytes"]) for t in entries) == content.encode()
    assert entries[0]["top_logprobs"][0]["token"] == "H"
    # Streamed one token at a time: the same strings.
    fmt = ChatFormat("m", tokenizer).for_choice(0)
    assert [fmt.logprobs([e])["content"][0]["token"] for e in events] == [t["token"] for t in entries]
