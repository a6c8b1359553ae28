"""The ASGI app: OpenAI-compatible routes over one `Worker`, and the web page at `/` (dgcli/data/web, no key: the
page's own API calls send it).

Owns: the routes, the API key check, admission (a body over 8 MiB is 413 unread, a full queue 429, shutting down
503), SSE streaming, and cancelling a request whose client went away (499). The event loop never does a request's
CPU work: JSON, the chat template and the tokenizer run in a thread pool under a time limit.
Must not: touch the engine (the worker's thread owns it) or parse request fields (protocol.py does).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from importlib.resources import files
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from dgcli.engine import Output
from dgcli.serve import protocol
from dgcli.serve.metrics import Metrics
from dgcli.serve.errors import ApiError
from dgcli.serve.protocol import Context, Spec
from dgcli.serve.worker import SHUTTING_DOWN, Job, Worker

log = logging.getLogger("dgemma.serve")
MAX_BODY = 8 * 1024 * 1024
# s for JSON + template + tokenizer (the character bound keeps a prompt well under a second) and a schema's compile,
# which on a 262,144-token vocabulary takes seconds (outlines-core's index walks the vocabulary once per state)
PARSE_TIMEOUT = 30.0
# Seconds a stream may stay silent before it sends an SSE comment: a block on a slow device (the 26B model on a
# CPU) takes minutes, and clients with a read timeout (httpx's, the openai client's) would give up on it
KEEPALIVE_S = 15.0
WEB = files("dgcli") / "data" / "web"  # the page at `/`: plain HTML, CSS and JS, no build step


class State:
    """What the routes share: the worker, the parsing context, the limits, the metrics, the parsing threads."""

    def __init__(self, worker: Worker, ctx: Context, *, max_queue: int, api_key: str | None,
                 stall_timeout: float = 60.0, parse_timeout: float = PARSE_TIMEOUT, keepalive: float = KEEPALIVE_S):
        self.worker, self.ctx, self.max_queue, self.api_key = worker, ctx, max_queue, api_key
        self.stall_timeout, self.parse_timeout, self.keepalive = stall_timeout, parse_timeout, keepalive
        self.metrics: Metrics = worker.metrics
        self.closing = False  # set on shutdown: new requests get 503
        # The tokenizer releases the GIL, so a few prompts tokenize side by side while the loop serves.
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dgemma-parse")


def _error(e: ApiError, state: State) -> JSONResponse:
    state.metrics.count(e.status)
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None  # clients back off, then retry
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _gone(state: State) -> Response:
    state.metrics.count(499)  # nginx's "client closed request"
    return Response(status_code=499)


def _authorized(request: Request, state: State) -> bool:
    if not state.api_key:
        return True
    got = request.headers.get("authorization", "")
    token = got[7:] if got.lower().startswith("bearer ") else ""
    return hmac.compare_digest(token.encode(), state.api_key.encode())


def _denied() -> ApiError:
    return ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")


async def _body(request: Request) -> bytes:
    """The raw body; too big is refused from its Content-Length, or (chunked) as soon as it passes the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise ApiError(413, f"the request body has {int(declared)} bytes; the limit is {MAX_BODY}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"the request body has more than {MAX_BODY} bytes, the limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(raw: bytes, chat: bool, ctx: Context) -> Spec:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # [[[[...]]]]: the decoder recurses once per level
        raise ApiError(400, "the request body nests arrays or objects too deeply; send a flat request "
                       "object (OpenAI's shape)") from None
    return protocol.parse(body, chat=chat, ctx=ctx)


async def _prepare(raw: bytes, chat: bool, state: State) -> Spec:
    """`_parse` in the pool, so that a big prompt never holds the event loop; past `parse_timeout` (only a busy
    server gets there: the character bound limits the work) 503."""
    future = asyncio.get_running_loop().run_in_executor(state.pool, _parse, raw, chat, state.ctx)
    try:
        return await asyncio.wait_for(future, state.parse_timeout)
    except asyncio.TimeoutError:
        raise ApiError(503, f"preparing the prompt took more than {state.parse_timeout:g} s: the server is "
                       "busy; retry later") from None


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def complete(request: Request, chat: bool) -> Response:
    state: State = request.app.state.dgemma
    try:
        if not _authorized(request, state):
            raise _denied()
        spec = await _prepare(await _body(request), chat, state)
        if state.closing:
            raise ApiError(503, SHUTTING_DOWN)
        with state.metrics.lock:
            waiting = state.metrics.queued
        if waiting >= state.max_queue:
            raise ApiError(429, f"the queue is full ({waiting} requests waiting for {state.worker.slots} slots); "
                           "retry later", code="queue_full")
    except ApiError as e:
        return _error(e, state)
    except ClientDisconnect:  # gone while sending its body (a slow or dropped client): nobody to answer
        return _gone(state)
    loop = asyncio.get_running_loop()
    output = Output(state.ctx.tokenizer, stop_strings=spec.stop, max_tokens=spec.max_tokens,
                    keep=spec.fmt.keep if spec.fmt else frozenset())
    job = Job(spec, output, loop, asyncio.Queue())
    state.worker.submit(job)
    if spec.stream:
        state.metrics.count(200)
        return StreamingResponse(_stream(job, state), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(request, job, state)


async def _whole(request: Request, job: Job, state: State) -> Response:
    """A non-streamed reply: wait for the end, watching the connection (a client gone cancels)."""
    reasoning, content = [], []
    name = state.ctx.model_name
    while True:
        try:
            message = await asyncio.wait_for(job.queue.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                state.worker.cancel(job)
                return _gone(state)
            continue
        except asyncio.CancelledError:  # the server stopped waiting for this request (shutdown timeout)
            state.worker.cancel(job)
            raise
        kind = message[0]
        if kind == "text":
            reasoning.append(message[1])
            content.append(message[2])
        elif kind == "end":
            state.metrics.count(200)
            body = protocol.reply(job.spec, name, "".join(reasoning), "".join(content), message[1], message[2])
            return JSONResponse(_noted(job.spec.fmt.reply(body) if job.spec.fmt and job.spec.chat else body, message))
        elif kind == "error":
            return _error(message[1], state)


def _noted(body: dict, end: tuple) -> dict:
    """The last body, with the worker's note on why the answer is empty as `dgemma_note` (clients ignore it)."""
    return {**body, "dgemma_note": end[3]} if len(end) > 3 and end[3] else body


async def _stream(job: Job, state: State) -> AsyncIterator[bytes]:
    """SSE chunks as protocol.py says, and `: keep-alive` after `state.keepalive` s of silence. A client that goes
    away cancels the generator (Starlette), and the `finally` withdraws the request."""
    spec, name = job.spec, state.ctx.model_name
    finished, held = False, []  # held: a tool call's text, sent as tool_calls at the end
    try:
        yield _sse(protocol.chunk(spec, name, content="", role=True))
        while True:
            try:  # a get cut short by the timeout takes nothing off the queue
                message = await asyncio.wait_for(job.queue.get(), state.keepalive)
            except asyncio.TimeoutError:
                yield b": keep-alive\n\n"
                continue
            kind = message[0]
            if kind == "text":
                now = spec.fmt.hold(held, message[2]) if spec.fmt is not None else message[2]
                if now or message[1] or not held:
                    yield _sse(protocol.chunk(spec, name, reasoning=message[1], content=now))
            elif kind == "draft":
                yield _sse(protocol.side_chunk(spec, name, dgemma_draft=message[1]))
            elif kind == "end":
                finished = True
                tail = spec.fmt.end_chunks(spec, name, "".join(held), message[1]) if spec.fmt else None
                if tail is None and held:  # cut short (length): the text as it is
                    yield _sse(protocol.chunk(spec, name, content="".join(held)))
                for c in tail[:-1] if tail else ():
                    yield _sse(c)
                yield _sse(_noted(tail[-1] if tail else protocol.chunk(spec, name, finish=message[1]), message))
                if spec.include_usage:
                    yield _sse(protocol.side_chunk(spec, name, usage=message[2]))
                break
            else:  # error: OpenAI's error object inside the stream, then the end
                finished = True
                yield _sse(message[1].body())
                break
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:
            state.worker.cancel(job)


async def models(request: Request) -> Response:
    """`GET /v1/models`, and `/v1/models/{model}`: the list's one entry, or OpenAI's 404 for another name."""
    state: State = request.app.state.dgemma
    if not _authorized(request, state):
        return _error(_denied(), state)
    ctx, name = state.ctx, request.path_params.get("model")
    card = {"id": ctx.model_name, "object": "model", "created": 0, "owned_by": "dgemma", "max_model_len": ctx.context}
    if name is None:
        return JSONResponse({"object": "list", "data": [card]})
    if name != ctx.model_name:
        return _error(ApiError(404, f"The model '{name}' does not exist; this server serves '{ctx.model_name}'",
                               param="model", code="model_not_found"), state)
    return JSONResponse(card)


async def health(request: Request) -> Response:
    """200; 503 while shutting down, when the engine thread has died, or busy past --stall-timeout."""
    state: State = request.app.state.dgemma
    if state.closing:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    if not state.worker.thread.is_alive():
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    age = state.metrics.engine_age()
    if state.stall_timeout and age > state.stall_timeout:
        with state.metrics.lock:
            queued, running = state.metrics.queued, state.metrics.running
        return JSONResponse({"status": "engine stalled", "last_progress_seconds": round(age, 1),
                             "stall_timeout_seconds": state.stall_timeout, "queued": queued, "running": running},
                            status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state: State = request.app.state.dgemma
    return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def page(request: Request) -> Response:
    return FileResponse(str(WEB / "index.html"), headers={"Cache-Control": "no-cache"})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    state: State = request.app.state.dgemma
    what = {404: f"no route {request.url.path}; see GET /v1/models, POST /v1/chat/completions, POST /v1/completions",
            405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return _error(ApiError(exc.status_code, what), state)


async def _crash(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s", request.url.path)
    state: State = request.app.state.dgemma
    return _error(ApiError(500, f"internal error ({type(exc).__name__}); see the server log"), state)


def _quiet_when_stopped(app: Starlette, state: State) -> Any:
    """`app` as uvicorn runs it: a request cancelled by a hard stop gets the 503 error object (a stream: and
    [DONE]) quietly, not uvicorn's traceback and text/plain 500."""

    async def guarded(scope: dict, receive: Any, send: Any) -> None:
        sent: dict = {}  # the response's start message, once sent

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                sent.update(message)
            await send(message)

        try:
            await app(scope, receive, send_and_note)
        except asyncio.CancelledError:
            if not state.closing or scope["type"] != "http":
                raise
            error = ApiError(503, SHUTTING_DOWN)
            stream = any(k == b"content-type" and v.startswith(b"text/event-stream")
                         for k, v in sent.get("headers", ()))
            with contextlib.suppress(Exception):  # a client that stopped reading gets nothing more
                if not sent:
                    await asyncio.wait_for(_error(error, state)(scope, receive, send), 0.5)
                elif stream:
                    tail = _sse(error.body()) + b"data: [DONE]\n\n"
                    await asyncio.wait_for(send({"type": "http.response.body", "body": tail, "more_body": False}), 0.5)

    return guarded


def build_app(state: State) -> Any:
    routes = [Route("/v1/chat/completions", functools.partial(complete, chat=True), methods=["POST"]),
              Route("/v1/completions", functools.partial(complete, chat=False), methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model:path}", models, methods=["GET"]),  # a name may hold a slash
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/", page, methods=["GET"]),
              Mount("/web", StaticFiles(directory=str(WEB)), name="web")]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _crash})
    app.state.dgemma = state
    return _quiet_when_stopped(app, state)
