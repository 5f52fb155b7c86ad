"""The HTTP surface: OpenAI-compatible endpoints over the engine, SSE streams, metrics and the web page.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (OpenAI shapes, `stream`
for server-sent events), POST /v1/denoise (the whole canvas after every step, masks as null; the
same frames ride a completions stream with `"denoise": true`), POST /tokenize and /detokenize
(vLLM's shapes), GET /health, GET /metrics (Prometheus text), GET / (the live denoising page, static
files shipped in the package; its icon at /favicon.ico). Errors are OpenAI error objects. With an API
key every /v1 request, /tokenize, /detokenize and /metrics need `Authorization: Bearer KEY` (401
otherwise); /health and the page itself are open (the page asks for the key and sends it with its
requests).

A body is checked before it is parsed (JSON content type, size) and parsed, validated and tokenized in a
worker thread: a long prompt never holds the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from dllm.config.profile import DecodeProfile
from dllm.config.sampler import SamplerConfig
from dllm.serving.body import check_content_type, load_json, read_body
from dllm.serving.engine import Engine
from dllm.serving.errors import ApiError
from dllm.serving.jobs import Job, RowResult
from dllm.serving.limits import Limits
from dllm.serving.prompts import chat_ids, check_prompts, request_prompts
from dllm.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    Settings,
    parse_detokenize,
    parse_request,
    parse_tokenize,
    request_fields,
    sampler_settings,
)
from dllm.serving.replies import Reply, from_json

STATIC = resources.files("dllm.serving") / "static"


@dataclass
class ServeState:
    engine: Engine
    base: SamplerConfig
    """The server's sampler defaults (resolved), under every request's own fields."""
    profile: DecodeProfile
    model_id: str
    limits: Limits
    api_key: str | None = None
    created: int = 0


def build_app(state: ServeState) -> FastAPI:
    """The FastAPI app over `state`; its lifespan starts and stops the engine's worker."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if not state.engine.thread.is_alive():
            state.engine.start()
        yield
        state.engine.stop()

    state.created = state.created or int(time.time())
    app = FastAPI(title="dllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")
    app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _crash)
    app.add_middleware(CountRequests, metrics=state.engine.metrics)
    api = Api(state)
    app.get("/", include_in_schema=False)(api.index)
    app.get("/favicon.ico", include_in_schema=False)(api.favicon)
    app.get("/health")(api.health)
    app.get("/metrics")(api.prometheus)
    app.get("/v1/models")(api.models)
    app.get("/v1/models/{model_id:path}")(api.model)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.post("/v1/denoise")(api.denoise)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    app.get("/tokenizer_info")(api.tokenizer_info)
    return app


def _top_logprobs(req: CompletionRequest | ChatRequest) -> int | None:
    """How many most likely tokens a request wants at each place (0: only its own), None: no scores."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs if req.logprobs is not None else (0 if req.echo else None)


async def _api_error(_request: Request, e: ApiError) -> JSONResponse:
    return e.response()


async def _http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
    code = "not_found" if e.status_code == 404 else None
    return ApiError(e.status_code, str(e.detail), code=code).response()


async def _crash(_request: Request, e: Exception) -> JSONResponse:  # never a dead server, never a traceback page
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error").response()


class Api:
    """The endpoints' handlers over one server's state."""

    def __init__(self, state: ServeState) -> None:
        self.state, self.metrics = state, state.engine.metrics

    # -- the open endpoints and the model list
    async def index(self) -> FileResponse:
        return FileResponse(str(STATIC / "index.html"))

    async def favicon(self) -> FileResponse:
        """The page's icon, also where browsers look for one unasked (no 404 in their logs)."""
        return FileResponse(str(STATIC / "favicon.svg"), media_type="image/svg+xml")

    async def health(self) -> dict[str, Any]:
        engine = self.state.engine
        return {"status": "ok", "model": self.state.model_id, "queue_length": engine.queued,
                "running_rows": engine.running}  # fmt: skip

    async def prometheus(self, request: Request) -> PlainTextResponse:
        self.authorize(request)
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> dict[str, Any]:
        self.authorize(request)
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, request: Request, model_id: str) -> dict[str, Any]:
        self.authorize(request)
        self.check_model(model_id)
        return self.model_card()

    def authorize(self, request: Request) -> None:
        key = self.state.api_key
        if key is None:
            return
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY", code="invalid_api_key",
                           kind="authentication_error")  # fmt: skip

    def model_card(self) -> dict[str, Any]:
        """OpenAI's model object, and under `dllm` how the server decodes it: its generation (canvas, causal,
        canvas_denoise) and the extra request fields that apply (the page sends only those)."""
        generation = self.state.base.generation
        return {"id": self.state.model_id, "object": "model", "created": self.state.created, "owned_by": "dllm",
                "dllm": {"generation": generation, "fields": list(request_fields(generation))}}  # fmt: skip

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.state.model_id:
            raise ApiError(404, f"model: {name!r} is not served here; GET /v1/models lists {self.state.model_id!r}",
                           param="model", code="model_not_found")  # fmt: skip

    # -- generation: parse, queue a job, answer whole or as a stream
    async def completions(self, request: Request) -> Response:
        return await self.handle(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self.handle(request, "chat")

    async def denoise(self, request: Request) -> Response:
        return await self.handle(request, "denoise")

    async def handle(self, request: Request, kind: str) -> Response:
        t0 = time.monotonic()
        self.authorize(request)
        raw = await self.read(request)
        req, prompts, settings = await asyncio.to_thread(self.prepare, raw, kind)
        stream = req.stream or kind == "denoise"
        events = Events(asyncio.get_running_loop())
        job = Job([p for p in prompts for _ in range(req.n)], settings, events.push,
                  stream_text=stream and kind != "denoise", denoise=kind == "denoise" or req.denoise,
                  top_logprobs=_top_logprobs(req), echo=isinstance(req, CompletionRequest) and req.echo)  # fmt: skip
        self.state.engine.submit(job)
        reply = Reply(kind, isinstance(req, ChatRequest), self.state.model_id, prompts, req, settings)
        if stream:
            return StreamingResponse(self.sse(request, reply, job, events, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        rows, counters = await self.wait_done(request, job, events)
        self.metrics.observe("dllm_time_to_first_token_seconds", time.monotonic() - t0)  # all tokens come at once
        self.metrics.observe("dllm_request_latency_seconds", time.monotonic() - t0)
        return JSONResponse(reply.final(rows, counters))

    async def read(self, request: Request) -> bytes:
        """The body, once its type is JSON and its size within the limit (before any parsing)."""
        check_content_type(request)
        return await read_body(request, self.state.limits.max_body_bytes)

    def prepare(self, raw: bytes, kind: str) -> tuple[CompletionRequest | ChatRequest, list[list[int]], Settings]:
        """The request, its prompts as token ids and its sampler (in a worker thread: this tokenizes)."""
        req = parse_request(load_json(raw), kind, causal=self.state.base.generation == "causal",
                            drafting=self.state.engine.drafter is not None)  # fmt: skip
        self.check_model(req.model)
        s = self.state
        settings = sampler_settings(req, s.base, s.profile, s.limits.max_steps)
        prompts = request_prompts(s.engine.tokenizer, req, s.limits)
        check_prompts(prompts, req, settings, s.profile, s.limits)
        return req, prompts, settings

    # -- the tokenizer, as vLLM serves it
    async def tokenize(self, request: Request) -> JSONResponse:
        return await self.off_loop(request, self.tokenize_now)

    async def off_loop(self, request: Request, work: Callable[[bytes], dict[str, Any]]) -> JSONResponse:
        """An authorized request's body handled by `work` in a worker thread (tokenizing is not for the event loop)."""
        self.authorize(request)
        raw = await self.read(request)
        return JSONResponse(await asyncio.to_thread(work, raw))

    def tokenize_now(self, raw: bytes) -> dict[str, Any]:
        req = parse_tokenize(load_json(raw))
        self.check_model(req.model)
        tok = self.state.engine.tokenizer
        ids = tok.encode(req.prompt) if req.messages is None else chat_ids(tok, req.messages, req.add_generation_prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.state.profile.max_length}

    async def tokenizer_info(self, request: Request) -> dict[str, Any]:
        """The special tokens (as text) and the context length: what lm-eval's remote tokenizer reads. No chat
        template: chats are rendered here (POST /tokenize with messages, or a chat completion)."""
        self.authorize(request)
        engine = self.state.engine
        tok = engine.tokenizer
        piece = engine.streams.piece
        bos = None if tok.bos_id is None else piece(tok.bos_id)
        return {"eos_token": piece(tok.eos_id), "bos_token": bos, "pad_token": piece(tok.pad_id),
                "chat_template": None, "model_max_length": self.state.profile.max_length}  # fmt: skip

    async def detokenize(self, request: Request) -> JSONResponse:
        return await self.off_loop(request, self.detokenize_now)

    def detokenize_now(self, raw: bytes) -> dict[str, Any]:
        req = parse_detokenize(load_json(raw))
        self.check_model(req.model)
        tok = self.state.engine.tokenizer
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"tokens.{bad}: {req.tokens[bad]} is not a token id of this model (ids lie in "
                           f"[0, {tok.vocab_size}))", param=f"tokens.{bad}", code="invalid_value")  # fmt: skip
        return {"prompt": tok.decode(req.tokens, skip_special=False)}

    async def wait_done(self, request: Request, job: Job, events: Events) -> tuple[list[RowResult], dict]:
        """The job's result; a client that goes away cancels it."""
        while True:
            kind, payload = await self.next_event(request, job, events)
            if kind == "error":
                raise payload
            if kind == "done":
                return payload

    async def next_event(self, request: Request, job: Job, events: Events) -> tuple[str, Any]:
        """The job's next event; every 0.25 s without one, whether the client is still there (a stream
        would only notice at its next write, which a long canvas may not make for a while)."""
        while True:
            try:
                return await asyncio.wait_for(events.queue.get(), 0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.cancel(job)
                    raise ApiError(499, "the client went away", code="client_closed") from None

    def cancel(self, job: Job) -> None:
        if not job.cancelled.is_set():
            job.cancelled.set()
            self.metrics.inc("dllm_cancelled_total")

    async def sse(self, request: Request, reply: Reply, job: Job, events: Events, t0: float) -> AsyncIterator[str]:
        done = first_token = False
        try:
            yield from_json(reply.opening())
            while not done:
                try:
                    kind, payload = await self.next_event(request, job, events)
                except ApiError:  # the client went away: nobody to write to
                    return
                if kind != "error" and not first_token:  # text, a frame, or the end of a text with none
                    first_token = True
                    self.metrics.observe("dllm_time_to_first_token_seconds", time.monotonic() - t0)
                if kind == "error":
                    yield from_json(payload.body())
                elif kind == "delta":
                    yield from_json(reply.delta(*payload))
                elif kind == "frame":
                    yield from_json(reply.frame(payload))
                elif kind == "done":
                    for chunk in reply.closing(*payload):
                        yield from_json(chunk)
                done = kind in ("error", "done")
            yield "data: [DONE]\n\n"
            if kind == "done":  # a failed call is not timed
                self.metrics.observe("dllm_request_latency_seconds", time.monotonic() - t0)
        finally:
            if not done:  # the client went away mid-stream (or the server stops): drop its work
                self.cancel(job)


class Events:
    """A job's events, pushed from the engine's thread into the request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.queue = loop, asyncio.Queue()

    def push(self, kind: str, payload: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop (the server stopped): nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))


class CountRequests:
    """Counts /v1 responses by endpoint and status. A plain ASGI middleware: starlette's
    BaseHTTPMiddleware wraps `receive`, and `request.is_disconnected()` then never sees a client leave."""

    def __init__(self, app: Any, metrics: Any) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        path = scope["path"]

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.inc("dllm_requests_total", endpoint=path, status=str(message["status"]))
            await send(message)

        await self.app(scope, receive, counted)
