"""The HTTP app (FastAPI): OpenAI's completions and chat completions, streamed as server-sent
events, plus ``/v1/models``, ``/health`` and ``/metrics``.

Each request is submitted to the engine before any byte of the response is sent, so a full
queue is a 429 (``Retry-After``) and a refused prompt a 400. The engine's thread hands the
request's events to the event loop (``EventPump``: one wake-up per batch of events); a
streamed response writes the events that have arrived since its last write in one chunk. When the
client goes away (a stream stops being read; a request for a whole answer polls for it), the request is
cancelled: the engine frees its row at the start of its next step. ``GET /`` is a chat page over
``/v1/chat/completions`` (``chat_page.html``).

Every error has OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: the requests'
own (``protocol``), and Starlette's and FastAPI's refusals (an unknown path, a wrong method), which
would otherwise answer ``{"detail": ...}``. While the server drains (``server``), a generation
request is a 503 with ``Retry-After`` and ``/health`` a 503 whose status is ``draining``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from mixtral_infer.errors import GenerationError
from mixtral_infer.generation.sampling_params import SEED_LIMIT
from mixtral_infer.generation.text_stream import TextStream
from mixtral_infer.serve.engine import Engine, Event, Finished, QueueFull, RequestSettings, ShuttingDown, TokenEvent
from mixtral_infer.serve.metrics import ServeMetrics
from mixtral_infer.serve.protocol import BadRequest, ParsedRequest, error_body, parse_chat, parse_completion, read_body
from mixtral_infer.serve.tools import TOOL_CALLS, has_tool_pieces, parse_calls
from mixtral_infer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from mixtral_infer.serve.engine_process import EngineProcess

CHAT_PAGE = Path(__file__).with_name("chat_page.html")
RETRY_AFTER_SECONDS = 1
DEFAULT_CHAT_TOKENS = 512  # an answer's length when a chat request gives no max_tokens (and a window allows it)
DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streamed request checks that its client is still there

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}
ENDPOINTS = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health, /metrics and /"


def make_app(
    engine: "Engine | EngineProcess", tokenizer: Tokenizer, model_name: str, metrics: ServeMetrics, on_ready=None,
    adapters: Sequence[str] = (),
) -> FastAPI:
    """The app over a built engine (in this process, or an ``EngineProcess``), which starts and
    stops with the app. ``adapters``: the names of the model's adapters kept apart, in the engine's
    order; a request names one as its ``model`` (``protocol._check_model``)."""
    served = [model_name, *adapters]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        if on_ready is not None:
            on_ready()
        yield
        engine.shutdown(cancel=True)  # uvicorn waited for the in-flight responses first

    app = FastAPI(title="mixtral_infer", lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, error: BadRequest):
        kind = "invalid_request_error" if error.status == 400 else "not_found_error"
        return JSONResponse(error_body(error.message, kind, error.param, error.code), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        """Starlette's refusals (an unknown path, a wrong method) in OpenAI's body, not ``{"detail": ...}``."""
        where = f"{request.method} {request.url.path}"
        if error.status_code == 404:
            message, kind = f"{where}: no such endpoint (this server has {ENDPOINTS})", "not_found_error"
        elif error.status_code == 405:
            allowed = (error.headers or {}).get("Allow", "")
            message, kind = f"{where}: method not allowed (this path takes {allowed or 'other methods'})", "invalid_request_error"
        else:
            message, kind = f"{where}: {error.detail}", "invalid_request_error"
        return JSONResponse(error_body(message, kind), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        """A failure of the server's own (a bug): a 500 in OpenAI's body; uvicorn logs the traceback."""
        message = f"the server failed on this request ({type(error).__name__}): its log has the traceback"
        return JSONResponse(error_body(message, "server_error"), status_code=500)

    def default_max_tokens(prompt_length: int) -> int:
        if engine.max_model_len is None:
            return DEFAULT_CHAT_TOKENS
        return min(DEFAULT_CHAT_TOKENS, engine.max_model_len - prompt_length)

    @app.post("/v1/completions")
    async def completions(request: Request):
        parsed = parse_completion(read_body(await request.body()), tokenizer, served)
        return await respond(request, parsed, CompletionFormat(served[parsed.settings.adapter], tokenizer))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        parsed = parse_chat(read_body(await request.body()), tokenizer, served, default_max_tokens)
        return await respond(request, parsed, ChatFormat(served[parsed.settings.adapter], tokenizer))

    pumps: Dict[int, EventPump] = {}

    def submit_all(parsed: ParsedRequest, sink_of: Callable[[int], Callable[[Event], None]]) -> List[Any]:
        """Every answer of the request to the engine (``choices``), each prompt's later choices
        following its first (they copy its row once it has read the prompt); all or none: the ones
        submitted are cancelled when a later one is refused."""
        handles: List[Any] = []
        try:
            for index, (prompt, settings) in enumerate(choices(parsed)):
                follows = handles[index - index % parsed.n] if index % parsed.n else None
                handles.append(engine.submit(prompt, settings, sink_of(index), follows=follows))
        except BaseException:
            for handle in handles:
                engine.cancel(handle)
            raise
        return handles

    def refused_field(parsed: ParsedRequest, chat: bool) -> str:
        """The field to blame for a request the engine refuses: its first prompt that does not fit
        the model's limit is the prompt's fault (a chat's: its messages') when it fills the limit
        alone, else its max_tokens' (the engine checks in that order: ``engine.check_request``)."""
        prompt_field = "messages" if chat else "prompt"
        limit = engine.max_model_len
        for prompt in parsed.prompts if limit is not None else []:
            if len(prompt) >= limit:
                return prompt_field
            if len(prompt) + parsed.settings.max_tokens > limit:
                return parsed.max_tokens_field
        return prompt_field

    async def respond(request: Request, parsed: ParsedRequest, fmt: "CompletionFormat"):
        loop = asyncio.get_running_loop()
        pump = pumps.setdefault(id(loop), EventPump(loop))
        events: asyncio.Queue[Tuple[int, Event]] = asyncio.Queue()
        try:
            handles = submit_all(parsed, lambda index: pump.sink(events, index))
        except (QueueFull, ShuttingDown) as error:
            metrics.rejected.inc()
            status, kind = (429, "rate_limit_error") if isinstance(error, QueueFull) else (503, "service_unavailable")
            return JSONResponse(
                error_body(f"{error}: retry later", kind), status_code=status, headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
            )
        except GenerationError as error:  # a prompt that can never run, or too long for its max_tokens
            return JSONResponse(error_body(str(error), param=refused_field(parsed, isinstance(fmt, ChatFormat))), status_code=400)
        answers = len(handles)
        formats = [fmt.for_choice(index) for index in range(answers)]
        if parsed.tools is not None:  # each choice's text is held while it may be a list of calls
            for f in formats:
                f.calls = CallStream(tokenizer)

        def cancel_all() -> None:
            for handle in handles:
                engine.cancel(handle)  # a no-op for those that have finished

        if parsed.stream:

            async def stream() -> AsyncIterator[str]:
                finished: Dict[int, Finished] = {}
                try:
                    yield "".join(sse(f.first_chunk()) for f in formats)
                    while True:
                        batch = [await events.get()]  # what has arrived since the last write, in one write
                        while not events.empty():
                            batch.append(events.get_nowait())
                        out = []
                        for index, event in batch:
                            f = formats[index]
                            if isinstance(event, Finished):
                                if event.reason == "error":
                                    out.append(sse(error_body(event.error or "generation failed", "server_error")))
                                    yield "".join(out) + "data: [DONE]\n\n"
                                    return
                                finished[index] = event
                                out.extend(sse(c) for c in f.final_chunks(event))
                            else:  # with tools, held while the answer may be calls
                                out.extend(f.token_sse(f.calls.push(event) if f.calls is not None else [event]))
                        if len(finished) == answers:
                            if parsed.include_usage:
                                out.append(sse(fmt.usage_chunk(usage(parsed, finished))))
                            yield "".join(out) + "data: [DONE]\n\n"
                            return
                        yield "".join(out)
                finally:
                    cancel_all()

            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        async def cancel_when_disconnected() -> None:
            # Polled on a clock of its own: a request that keeps producing tokens must notice too.
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_SECONDS)
            cancel_all()

        received: List[List[TokenEvent]] = [[] for _ in range(answers)]
        ends: Dict[int, Finished] = {}
        watcher = asyncio.create_task(cancel_when_disconnected())
        try:
            while len(ends) < answers:
                index, event = await events.get()
                if isinstance(event, Finished):
                    ends[index] = event
                    if event.reason == "error":
                        break
                else:
                    received[index].append(event)
        finally:
            watcher.cancel()
            cancel_all()
        if watcher.done() and not watcher.cancelled():  # the client left: nobody reads an answer
            return Response(status_code=499)
        failed = next((e for e in ends.values() if e.reason == "error"), None)
        if failed is not None:
            return JSONResponse(error_body(failed.error or "generation failed", "server_error"), status_code=500)
        body = fmt.envelope([formats[i].whole_choice(received[i], ends[i], parsed.settings.logprobs is not None) for i in range(answers)])
        if isinstance(fmt, ChatFormat):
            body["object"] = "chat.completion"
        return JSONResponse({**body, "usage": usage(parsed, ends)})

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        """A chat page over this server's own /v1/chat/completions (serve/chat_page.html)."""
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    @app.get("/v1/models")
    async def models():
        model = {"id": model_name, "object": "model", "created": created, "owned_by": "mixtral_infer"}
        return {"object": "list", "data": [model] + [{**model, "id": name, "parent": model_name} for name in adapters]}

    @app.get("/health")
    async def health():
        """200 while serving; 503 while draining (a load balancer sends new requests elsewhere), or
        once the engine's process has stopped."""
        stats = engine.stats()
        if getattr(engine, "stopped", False):
            return JSONResponse({"status": "engine stopped", **stats}, status_code=503)
        if engine.draining:
            return JSONResponse({"status": "draining", **stats}, status_code=503)
        return {"status": "ok", **stats}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


def choices(parsed: ParsedRequest) -> List[Tuple[List[int], RequestSettings]]:
    """Each answer's prompt and settings, in index order (prompt ``p``'s choice ``i`` is ``p * n + i``).
    With a seed, choice ``i`` samples with ``seed + i``, so that the choices differ and each is the
    answer a request with that seed alone gets."""
    out = []
    for prompt in parsed.prompts:
        for i in range(parsed.n):
            seed = parsed.settings.seed
            settings = parsed.settings if i == 0 or seed is None else replace(parsed.settings, seed=(seed + i) % SEED_LIMIT)
            out.append((prompt, settings))
    return out


def usage(parsed: ParsedRequest, finished: Dict[int, Finished]) -> Dict[str, int]:
    """Each prompt's tokens once, and every answer's tokens."""
    prompt_tokens = sum(len(p) for p in parsed.prompts)
    completion_tokens = sum(f.completion_tokens for f in finished.values())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


class EventPump:
    """Hands the engine's events to the event loop in batches.

    Waking the loop costs a system call; waking it once per token would cost one per row per
    step. Events are collected under a lock, and one wake-up is scheduled per batch.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: List[tuple] = []
        self.lock = threading.Lock()
        self.scheduled = False

    def sink(self, queue: "asyncio.Queue[Tuple[int, Event]]", index: int = 0):
        """A sink for the engine that puts ``(index, event)`` on ``queue`` in the event loop."""

        def put(event: Event) -> None:  # called in the engine's thread
            with self.lock:
                self.pending.append((queue, (index, event)))
                if self.scheduled:
                    return
                self.scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens any more
                self.loop.call_soon_threadsafe(self._flush)

        return put

    def _flush(self) -> None:
        with self.lock:
            pending, self.pending, self.scheduled = self.pending, [], False
        for queue, event in pending:
            queue.put_nowait(event)


def sse(payload: Dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


TEXT_MARK = "\ue000text\ue000"  # stands for a chunk's text in CompletionFormat.text_sse's template


class CompletionFormat:
    """Response bodies of ``/v1/completions`` (``text_completion``)."""

    object_name = "text_completion"

    def __init__(self, model_name: str, tokenizer: Tokenizer):
        self.model_name, self.tokenizer = model_name, tokenizer
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.index = 0  # the choice this object writes (for_choice)
        self.calls: Optional[CallStream] = None  # a chat with tools: the text held while it may be calls
        self._text_template: Optional[List[str]] = None
        self._offset = 0  # characters of the completion's text before the next token's logprobs entry

    def for_choice(self, index: int) -> "CompletionFormat":
        """The bodies of choice ``index`` of the same response (same id and time, a text offset of its own)."""
        other = copy.copy(self)
        other.index, other._text_template, other._offset = index, None, 0
        return other

    def text_sse(self, text: str) -> str:
        """``sse(self.chunk(text, None, None))``, the event of a streamed token's text, from a
        template made once per response: only the text is encoded per token, since the server's
        process does this for every token of every stream (docs/performance.md, "Serving")."""
        if self._text_template is None:
            self._text_template = sse(self.chunk(TEXT_MARK, None, None)).split(json.dumps(TEXT_MARK, ensure_ascii=False))
        before, after = self._text_template
        return before + json.dumps(text, ensure_ascii=False) + after

    def token_sse(self, events: List[TokenEvent]) -> List[str]:
        """The events of streamed tokens (one chunk for those released together), with their
        logprobs when the request asked for them."""
        text = "".join(e.text for e in events)
        if events and events[0].logprob is not None:
            return [sse(self.chunk(text, self.logprobs(events), None))]
        return [self.text_sse(text)] if text else []

    def token_text(self, token: int) -> str:
        return self.tokenizer.id_to_piece(token).replace("\u2581", " ")

    def envelope(self, choices: List[Dict[str, Any]], object_name: Optional[str] = None) -> Dict[str, Any]:
        return {
            "id": self.id, "object": object_name or self.object_name, "created": self.created,
            "model": self.model_name, "choices": choices,
        }  # fmt: skip

    def first_chunk(self) -> Dict[str, Any]:
        return self.chunk("", None, None)

    def chunk(self, text: str, logprobs: Optional[Dict[str, Any]], finish_reason: Optional[str]) -> Dict[str, Any]:
        return self.envelope([{"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])

    def final_chunks(self, finished: Finished) -> List[Dict[str, Any]]:
        """A streamed choice's last chunks: its held text and its finish reason."""
        return [self.chunk(finished.text, None, FINISH_REASONS[finished.reason])]

    def usage_chunk(self, usage: Dict[str, int]) -> Dict[str, Any]:
        return {**self.envelope([]), "usage": usage}

    def logprobs(self, events: List[TokenEvent]) -> Dict[str, Any]:
        """OpenAI's legacy logprobs of these tokens, the next of the response's (a stream's one at a
        time, or all at once): ``text_offset`` is where each token's text starts in the completion's
        text (a token whose text is held back for a stop string starts where the held text will)."""
        offsets = []
        for event in events:
            offsets.append(self._offset)
            self._offset += len(event.text)
        return {
            "tokens": [self.token_text(e.token) for e in events],
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{self.token_text(t): lp for t, lp in e.top_logprobs or []} for e in events],
            "text_offset": offsets,
        }

    def whole_choice(self, events: List[TokenEvent], finished: Finished, with_logprobs: bool) -> Dict[str, Any]:
        """One choice of a response that is not streamed."""
        text = "".join(e.text for e in events) + finished.text
        return {
            "index": self.index, "text": text, "logprobs": self.logprobs(events) if with_logprobs else None,
            "finish_reason": FINISH_REASONS[finished.reason],
        }  # fmt: skip


class CallStream:
    """A streamed chat choice with tools: its tokens are held while it may be a list of calls (the
    first token is ``[TOOL_CALLS]`` for a tokenizer with Mistral's tool pieces; else the text begins
    as ``[TOOL_CALLS]`` does), and sent as they come once it cannot be."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pieces = has_tool_pieces(tokenizer)
        self.events: List[TokenEvent] = []  # every token of the answer
        self.held = 0  # events[held:] are not sent yet
        self.text = ""
        self.deciding, self.calling = True, False

    def push(self, event: TokenEvent) -> List[TokenEvent]:
        """The tokens to send now: none while held, then the held ones with this one."""
        self.events.append(event)
        self.text += event.text
        if self.deciding:
            if self.pieces:
                self.calling = event.token == self.tokenizer.control_ids(TOOL_CALLS)[0]
            else:
                start = self.text.lstrip()
                if TOOL_CALLS.startswith(start):
                    return []  # still a prefix of [TOOL_CALLS]: held
                self.calling = start.startswith(TOOL_CALLS)
            self.deciding = False
        if self.calling:
            return []
        released, self.held = self.events[self.held :], len(self.events)
        return released

    def finish(self, finished: Finished) -> Tuple[Optional[List[Dict[str, Any]]], List[TokenEvent]]:
        """``(calls, the tokens not sent)`` when the answer is a list of calls (the complete ones of a
        list that ``max_tokens`` cut), else ``(None, the tokens not sent)``, whose text with
        ``finished.text`` is the text still to send."""
        held = self.events[self.held :]
        calls = None
        if self.calling or self.deciding:
            tokens = [e.token for e in self.events]
            calls = parse_calls(tokens, self.text + finished.text, self.tokenizer, cut=finished.reason == "length")
        return calls, held


class ChatFormat(CompletionFormat):
    """Response bodies of ``/v1/chat/completions``."""

    object_name = "chat.completion.chunk"

    def __init__(self, model_name: str, tokenizer: Tokenizer):
        super().__init__(model_name, tokenizer)
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self._content = TextStream(tokenizer, leading_space=False)  # the choice's text, as the engine writes it

    def for_choice(self, index: int) -> "ChatFormat":
        other = super().for_choice(index)
        other._content = TextStream(self.tokenizer, leading_space=False)
        return other

    def first_chunk(self) -> Dict[str, Any]:
        return self.envelope([{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])

    def chunk(self, text: str, logprobs: Optional[Dict[str, Any]], finish_reason: Optional[str]) -> Dict[str, Any]:
        delta = {"content": text} if text or finish_reason is None else {}
        return self.envelope([{"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def logprobs(self, events: List[TokenEvent]) -> Dict[str, Any]:
        """OpenAI's chat logprobs of these tokens, the next of the choice's (a stream's one at a time,
        or all at once). As OpenAI's, the tokens' strings make up ``message.content``: each ``token``
        is the text it adds to the answer, decoded as the engine decodes it. So the first token's
        space, which a chat answer drops (sentencepiece's ``▁Hello`` starts the answer as ``Hello``),
        is not in it, and a character written in several byte tokens is the last one's text (the
        others' ``""``). ``bytes`` are the token's own bytes as they stand in the answer (joined, the
        answer's UTF-8). An alternative in ``top_logprobs`` is named by its piece (its space dropped
        at the first position, as the chosen token's)."""
        content = []
        for e in events:
            first = not self._content.tokens
            text = self._content.push(e.token)
            alternatives = []
            for token, logprob in e.top_logprobs or []:
                name, raw = self._as_written(token, self.token_text(token), first)
                alternatives.append({"token": name, "logprob": logprob, "bytes": list(raw)})
            raw = self._as_written(e.token, text, first)[1]
            content.append({"token": text, "logprob": e.logprob, "bytes": list(raw), "top_logprobs": alternatives})
        return {"content": content}

    def _as_written(self, token: int, name: str, first: bool) -> Tuple[str, bytes]:
        """A token's name and bytes as they stand in a chat answer: at its start (``first``), without
        the space that the decode drops (sentencepiece's; tekken's decode keeps it)."""
        raw = self.tokenizer.token_bytes(token)
        if first and raw.startswith(b" ") and not self.tokenizer.decode([token]).startswith(" "):
            return name[1:] if name.startswith(" ") else name, raw[1:]
        return name, raw

    def final_chunks(self, finished: Finished) -> List[Dict[str, Any]]:
        """A streamed choice's last chunks; with tools, either its calls (OpenAI's ``tool_calls`` deltas,
        each call whole) or the text held while it might have been one."""
        if self.calls is None:
            return super().final_chunks(finished)
        calls, held = self.calls.finish(finished)
        logprobs = self.logprobs(held) if held and held[0].logprob is not None else None
        if calls is None:
            text = "".join(e.text for e in held) + finished.text
            return [self.chunk(text, logprobs, FINISH_REASONS[finished.reason])]
        deltas = [{"index": i, **call} for i, call in enumerate(calls)]
        return [
            self.envelope([{"index": self.index, "delta": {"tool_calls": deltas}, "logprobs": logprobs, "finish_reason": None}]),
            self.envelope([{"index": self.index, "delta": {}, "logprobs": None, "finish_reason": calls_finish(finished)}]),
        ]

    def whole_choice(self, events: List[TokenEvent], finished: Finished, with_logprobs: bool) -> Dict[str, Any]:
        text = "".join(e.text for e in events) + finished.text
        calls = None
        if self.calls is not None:
            calls = parse_calls([e.token for e in events], text, self.tokenizer, cut=finished.reason == "length")
        if calls is not None:
            return {
                "index": self.index, "message": {"role": "assistant", "content": None, "tool_calls": calls},
                "logprobs": self.logprobs(events) if with_logprobs else None, "finish_reason": calls_finish(finished),
            }  # fmt: skip
        return {
            "index": self.index, "message": {"role": "assistant", "content": text},
            "logprobs": self.logprobs(events) if with_logprobs else None, "finish_reason": FINISH_REASONS[finished.reason],
        }  # fmt: skip


def calls_finish(finished: Finished) -> str:
    """The finish reason of an answer that is calls: ``tool_calls``, or ``length`` when ``max_tokens``
    cut the list (its complete calls are the answer's, the unfinished last one dropped)."""
    return "length" if finished.reason == "length" else "tool_calls"
