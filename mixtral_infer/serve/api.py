"""The HTTP app (FastAPI): OpenAI's completions and chat completions, streamed as server-sent
events, plus ``/v1/models``, ``/health`` and ``/metrics``.

Each request is submitted to the engine before any byte of the response is sent, so a full
queue is a 429 (``Retry-After``) and a refused prompt a 400. The engine's thread hands the
request's events to the event loop (``EventPump``: one wake-up per batch of events); a
streamed response writes the events that have arrived since its last write in one chunk. When the
client goes away (a stream stops being read; a request for a whole answer polls for it), the request is
cancelled: the engine frees its row at the start of its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from mixtral_infer.errors import GenerationError
from mixtral_infer.serve.engine import Engine, Event, Finished, QueueFull, ShuttingDown, TokenEvent
from mixtral_infer.serve.metrics import ServeMetrics
from mixtral_infer.serve.protocol import BadRequest, ParsedRequest, error_body, parse_chat, parse_completion, read_body
from mixtral_infer.tokenizer import Tokenizer

if TYPE_CHECKING:
    from mixtral_infer.serve.engine_process import EngineProcess

RETRY_AFTER_SECONDS = 1
DEFAULT_CHAT_TOKENS = 512  # an answer's length when a chat request gives no max_tokens (and a window allows it)
DISCONNECT_POLL_SECONDS = 0.25  # how often a non-streamed request checks that its client is still there

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


def make_app(
    engine: "Engine | EngineProcess", tokenizer: Tokenizer, model_name: str, metrics: ServeMetrics, on_ready=None
) -> FastAPI:
    """The app over a built engine (in this process, or an ``EngineProcess``), which starts and
    stops with the app."""

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

    def default_max_tokens(prompt_length: int) -> int:
        if engine.max_model_len is None:
            return DEFAULT_CHAT_TOKENS
        return min(DEFAULT_CHAT_TOKENS, engine.max_model_len - prompt_length)

    @app.post("/v1/completions")
    async def completions(request: Request):
        parsed = parse_completion(read_body(await request.body()), tokenizer, model_name)
        return await respond(request, parsed, CompletionFormat(model_name, tokenizer))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        parsed = parse_chat(read_body(await request.body()), tokenizer, model_name, default_max_tokens)
        return await respond(request, parsed, ChatFormat(model_name, tokenizer))

    pumps: Dict[int, EventPump] = {}

    async def respond(request: Request, parsed: ParsedRequest, fmt: "CompletionFormat"):
        loop = asyncio.get_running_loop()
        pump = pumps.setdefault(id(loop), EventPump(loop))
        events: asyncio.Queue[Event] = asyncio.Queue()
        try:
            handle = engine.submit(parsed.prompt, parsed.settings, pump.sink(events))
        except (QueueFull, ShuttingDown) as error:
            metrics.rejected.inc()
            status, kind = (429, "rate_limit_error") if isinstance(error, QueueFull) else (503, "service_unavailable")
            return JSONResponse(
                error_body(f"{error}: retry later", kind), status_code=status, headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
            )
        except GenerationError as error:  # the prompt: a chat's comes from its messages
            param = "messages" if isinstance(fmt, ChatFormat) else "prompt"
            return JSONResponse(error_body(str(error), param=param), status_code=400)

        if parsed.stream:

            async def stream() -> AsyncIterator[str]:
                try:
                    yield sse(fmt.first_chunk())
                    while True:
                        batch = [await events.get()]  # what has arrived since the last write, in one write
                        while not events.empty():
                            batch.append(events.get_nowait())
                        out = []
                        for event in batch:
                            if isinstance(event, Finished):
                                out.append(final_chunks(event))
                                break
                            if event.logprob is not None:
                                out.append(sse(fmt.chunk(event.text, fmt.logprobs([event]), None)))
                            elif event.text:
                                out.append(fmt.text_sse(event.text))
                        yield "".join(out)
                        if isinstance(batch[-1], Finished):
                            return
                finally:
                    engine.cancel(handle)  # a no-op when it has finished

            def final_chunks(event: Finished) -> str:
                if event.reason == "error":
                    last = sse(error_body(event.error or "generation failed", "server_error"))
                else:
                    last = sse(fmt.chunk(event.text, None, FINISH_REASONS[event.reason]))
                    if parsed.include_usage:
                        last += sse(fmt.usage_chunk(event))
                return last + "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        async def cancel_when_disconnected() -> None:
            # Polled on a clock of its own: a request that keeps producing tokens must notice too.
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_SECONDS)
            engine.cancel(handle)

        received: List[TokenEvent] = []
        watcher = asyncio.create_task(cancel_when_disconnected())
        try:
            while not isinstance(event := await events.get(), Finished):
                received.append(event)
        finally:
            watcher.cancel()
            engine.cancel(handle)
        if watcher.done() and not watcher.cancelled():  # the client left: nobody reads an answer
            return Response(status_code=499)
        if event.reason == "error":
            return JSONResponse(error_body(event.error or "generation failed", "server_error"), status_code=500)
        return JSONResponse(fmt.whole(received, event, parsed.settings.logprobs is not None))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "mixtral_infer"}]}

    @app.get("/health")
    async def health():
        stats = engine.stats()
        if engine.draining:
            return JSONResponse({"status": "shutting down", **stats}, status_code=503)
        return {"status": "ok", **stats}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


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

    def sink(self, queue: "asyncio.Queue[Event]"):
        def put(event: Event) -> None:  # called in the engine's thread
            with self.lock:
                self.pending.append((queue, event))
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
        self._text_template: Optional[List[str]] = None
        self._offset = 0  # characters of the completion's text before the next token's logprobs entry

    def text_sse(self, text: str) -> str:
        """``sse(self.chunk(text, None, None))``, the event of a streamed token's text, from a
        template made once per response: only the text is encoded per token, since the server's
        process does this for every token of every stream (docs/performance.md, "Serving")."""
        if self._text_template is None:
            self._text_template = sse(self.chunk(TEXT_MARK, None, None)).split(json.dumps(TEXT_MARK, ensure_ascii=False))
        before, after = self._text_template
        return before + json.dumps(text, ensure_ascii=False) + after

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
        return self.envelope([{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}])

    def usage(self, finished: Finished) -> Dict[str, int]:
        total = finished.prompt_tokens + finished.completion_tokens
        return {"prompt_tokens": finished.prompt_tokens, "completion_tokens": finished.completion_tokens, "total_tokens": total}

    def usage_chunk(self, finished: Finished) -> Dict[str, Any]:
        return {**self.envelope([]), "usage": self.usage(finished)}

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

    def whole(self, events: List[TokenEvent], finished: Finished, with_logprobs: bool) -> Dict[str, Any]:
        text = "".join(e.text for e in events) + finished.text
        choice = {
            "index": 0, "text": text, "logprobs": self.logprobs(events) if with_logprobs else None,
            "finish_reason": FINISH_REASONS[finished.reason],
        }  # fmt: skip
        return {**self.envelope([choice]), "usage": self.usage(finished)}


class ChatFormat(CompletionFormat):
    """Response bodies of ``/v1/chat/completions``."""

    object_name = "chat.completion.chunk"

    def __init__(self, model_name: str, tokenizer: Tokenizer):
        super().__init__(model_name, tokenizer)
        self.id = f"chatcmpl-{uuid.uuid4().hex}"

    def first_chunk(self) -> Dict[str, Any]:
        return self.envelope([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])

    def chunk(self, text: str, logprobs: Optional[Dict[str, Any]], finish_reason: Optional[str]) -> Dict[str, Any]:
        delta = {"content": text} if text or finish_reason is None else {}
        return self.envelope([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])

    def logprobs(self, events: List[TokenEvent]) -> Dict[str, Any]:
        def entry(token: int, logprob: float) -> Dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top_logprobs or []]} for e in events]}

    def whole(self, events: List[TokenEvent], finished: Finished, with_logprobs: bool) -> Dict[str, Any]:
        text = "".join(e.text for e in events) + finished.text
        choice = {
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": self.logprobs(events) if with_logprobs else None, "finish_reason": FINISH_REASONS[finished.reason],
        }  # fmt: skip
        return {**self.envelope([choice], "chat.completion"), "usage": self.usage(finished)}
