"""The HTTP surface: OpenAI-compatible endpoints over the engine, SSE streams, metrics and the web page.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (OpenAI shapes, `stream`
for server-sent events), POST /v1/denoise (the whole canvas after every step, masks as null; the
same frames ride a completions stream with `"denoise": true`), GET /health, GET /metrics
(Prometheus text), GET / (the live denoising page, static files shipped in the package).
Errors are OpenAI error objects. With an API key every /v1 request and /metrics needs
`Authorization: Bearer KEY` (401 otherwise); /health and the page itself are open (the page asks
for the key and sends it with its requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from dllm.config.profile import DecodeProfile
from dllm.config.sampler import SamplerConfig
from dllm.serving.engine import Engine, Job, RowResult
from dllm.serving.protocol import ApiError, ChatRequest, CompletionRequest, Settings, parse_body, sampler_settings

MAX_ROWS = 256  # rows (prompts x n) one request may ask for


@dataclass
class ServeState:
    engine: Engine
    base: SamplerConfig
    """The server's sampler defaults (resolved), under every request's own fields."""
    profile: DecodeProfile
    model_id: str
    api_key: str | None = None
    created: int = 0


def build_app(state: ServeState) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine's worker."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if not state.engine.thread.is_alive():
            state.engine.start()
        yield
        state.engine.stop()

    state.created = state.created or int(time.time())
    app = FastAPI(title="dllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    static = resources.files("dllm.serving") / "static"
    app.mount("/static", StaticFiles(directory=str(static)), name="static")
    metrics = state.engine.metrics

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return JSONResponse(ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(_request: Request, e: Exception) -> JSONResponse:  # never a dead server, never a traceback page
        err = ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
        return JSONResponse(err.body(), status_code=500)

    app.add_middleware(CountRequests, metrics=metrics)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {state.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer KEY", code="invalid_api_key",
                           kind="authentication_error")  # fmt: skip

    def model_card() -> dict[str, Any]:
        return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "dllm"}

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(str(static / "index.html"))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": state.model_id,
            "queue_length": len(state.engine.queue),
            "running_rows": state.engine.running,
        }

    @app.get("/metrics")
    async def prometheus(request: Request) -> PlainTextResponse:
        authorize(request)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        authorize(request)
        check_model(model_id)
        return model_card()

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_id:
            raise ApiError(404, f"model: {name!r} is not served here; GET /v1/models lists {state.model_id!r}",
                           param="model", code="model_not_found")  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat")

    @app.post("/v1/denoise")
    async def denoise(request: Request) -> Response:
        return await handle(request, "denoise")

    async def handle(request: Request, kind: str) -> Response:
        t0 = time.monotonic()
        authorize(request)
        raw = await request.body()
        chat = kind == "chat" or (kind == "denoise" and _has_messages(raw))
        req = parse_body(raw, ChatRequest if chat else CompletionRequest)
        check_model(req.model)
        prompts = chat_prompt(req) if chat else completion_prompts(req)  # type: ignore[arg-type]
        settings = sampler_settings(req, state.base, state.profile)
        check_lengths(prompts, settings)
        stream = req.stream or kind == "denoise"
        show_frames = kind == "denoise" or bool((req.model_extra or {}).get("denoise"))
        if len(prompts) * req.n > MAX_ROWS:
            raise ApiError(400, f"n: {len(prompts)} prompts x n {req.n} make more than {MAX_ROWS} rows; split the "
                           "request", param="n")  # fmt: skip
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def push(kind: str, payload: Any) -> None:  # called from the engine's thread
            with contextlib.suppress(RuntimeError):  # a closed event loop (the server stopped): nobody listens
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

        job = Job([p for p in prompts for _ in range(req.n)], settings, push, stream_text=stream and kind != "denoise",
                  denoise=show_frames)  # fmt: skip
        state.engine.submit(job)
        reply = Reply(kind, chat, state.model_id, prompts, req, settings)
        if stream:
            return StreamingResponse(sse(request, reply, job, events, t0), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        rows, counters = await wait_done(request, job, events)
        metrics.observe_request(time.monotonic() - t0)
        return JSONResponse(reply.final(rows, counters))

    async def wait_done(request: Request, job: Job, events: asyncio.Queue) -> tuple[list[RowResult], dict]:
        """The job's result; a client that goes away cancels it."""
        while True:
            kind, payload = await next_event(request, job, events)
            if kind == "error":
                raise payload
            if kind == "done":
                return payload

    async def next_event(request: Request, job: Job, events: asyncio.Queue) -> tuple[str, Any]:
        """The job's next event; every 0.25 s without one, whether the client is still there (a stream
        would only notice at its next write, which a long canvas may not make for a while)."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), 0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    cancel(job)
                    raise ApiError(499, "the client went away", code="client_closed") from None

    def cancel(job: Job) -> None:
        if not job.cancelled.is_set():
            job.cancelled.set()
            metrics.inc("dllm_cancelled_total")

    async def sse(request: Request, reply: Reply, job: Job, events: asyncio.Queue, t0: float) -> AsyncIterator[str]:
        done = False
        try:
            yield from_json(reply.opening())
            while True:
                try:
                    kind, payload = await next_event(request, job, events)
                except ApiError:  # the client went away: nobody to write to
                    return
                if kind == "error":
                    yield from_json(payload.body())
                    done = True
                    break
                if kind == "delta":
                    yield from_json(reply.delta(*payload))
                elif kind == "frame":
                    yield from_json(reply.frame(payload))
                elif kind == "done":
                    for chunk in reply.closing(*payload):
                        yield from_json(chunk)
                    done = True
                    break
            yield "data: [DONE]\n\n"
            metrics.observe_request(time.monotonic() - t0)
        finally:
            if not done:  # the client went away mid-stream (or the server stops): drop its work
                cancel(job)

    def completion_prompts(req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            out = [state.engine.tokenizer.encode(p)]
        elif p and all(isinstance(x, int) for x in p):
            out = [list(p)]  # type: ignore[arg-type]
        else:
            out = [state.engine.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in p]  # type: ignore[union-attr]
        if not out:
            raise ApiError(400, "prompt: give at least one prompt", param="prompt", code="invalid_value")
        return out

    def chat_prompt(req: ChatRequest) -> list[list[int]]:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        try:
            return [state.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True).ids]
        except Exception as e:  # a template that refuses the conversation (roles, order)
            raise ApiError(400, f"messages: the chat template refused them ({e})", param="messages") from None

    def check_lengths(prompts: list[list[int]], settings: Settings) -> None:
        p, g = state.profile, settings.cfg.gen_length
        for ids in prompts:
            if any(not 0 <= t < p.num_tokens for t in ids):
                raise ApiError(400, f"prompt: token ids must lie in [0, {p.num_tokens})", param="prompt")
            if p.shift and not ids:
                raise ApiError(400, "prompt: this model predicts each token from the one before; give a non-empty "
                               "prompt", param="prompt")  # fmt: skip
            if len(ids) + g > p.max_length:
                raise ApiError(400, f"max_tokens: the prompt ({len(ids)} tokens) plus {g} generated tokens exceed "
                               f"the model's {p.max_length} positions; shorten the prompt or lower max_tokens",
                               param="max_tokens", code="context_length_exceeded")  # fmt: skip

    return app


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


def from_json(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _has_messages(raw: bytes) -> bool:
    try:
        data = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and "messages" in data


@dataclass
class Reply:
    """The OpenAI shapes of one request's answer: whole, or as stream chunks."""

    kind: str  # completion, chat or denoise
    chat: bool
    model_id: str
    prompts: list[list[int]]
    req: Any
    settings: Settings

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id}

    def usage(self, rows: list[RowResult]) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(r.completion_tokens for r in rows)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def final(self, rows: list[RowResult], counters: dict) -> dict[str, Any]:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "finish_reason":
                        r.finish_reason, "logprobs": None} for i, r in enumerate(rows)]  # fmt: skip
            body = {**self._head("chat.completion"), "choices": choices}
        else:
            choices = [{"index": i, "text": r.text, "finish_reason": r.finish_reason, "logprobs": None}
                       for i, r in enumerate(rows)]  # fmt: skip
            body = {**self._head("text_completion"), "choices": choices}
        return {**body, "usage": self.usage(rows), "dllm": _sampler_counters(counters)}

    def opening(self) -> dict[str, Any]:
        """The first event: the chat role, or the canvas size of a denoising stream."""
        if self.kind == "denoise":
            return {**self._head("denoise.start"), "max_tokens": self.settings.max_tokens, "n": len(self.prompts) *
                    self.req.n, "steps": self.settings.cfg.total_steps}  # fmt: skip
        if self.chat:
            choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                       for i in range(len(self.prompts) * self.req.n)]  # fmt: skip
            return {**self._head("chat.completion.chunk"), "choices": choices}
        choices = [{"index": i, "text": "", "finish_reason": None, "logprobs": None}
                   for i in range(len(self.prompts) * self.req.n)]  # fmt: skip
        return {**self._head("text_completion"), "choices": choices}

    def delta(self, index: int, text: str) -> dict[str, Any]:
        if self.chat:
            return {**self._head("chat.completion.chunk"),
                    "choices": [{"index": index, "delta": {"content": text}, "finish_reason": None}]}  # fmt: skip
        return {**self._head("text_completion"),
                "choices": [{"index": index, "text": text, "finish_reason": None, "logprobs": None}]}  # fmt: skip

    def frame(self, frame: dict[str, Any]) -> dict[str, Any]:
        masked = sum(t is None for row in frame["rows"] for t in row)
        choices = [{"index": i, "tokens": row} for i, row in enumerate(frame["rows"])]
        return {**self._head("denoise.frame"), "step": frame["step"], "block": frame["block"],
                "committed": frame["committed"], "masked": masked, "final": frame["last"], "nfe": frame["nfe"],
                "choices": choices}  # fmt: skip

    def closing(self, rows: list[RowResult], counters: dict) -> list[dict[str, Any]]:
        if self.kind == "denoise":  # one shape for prompts and conversations: the text of each row
            choices = [{"index": i, "text": r.text, "finish_reason": r.finish_reason} for i, r in enumerate(rows)]
            return [{**self._head("denoise.done"), "choices": choices, "usage": self.usage(rows),
                     "dllm": _sampler_counters(counters)}]  # fmt: skip
        if self.chat:
            choices = [{"index": i, "delta": {}, "finish_reason": r.finish_reason} for i, r in enumerate(rows)]
            out = [{**self._head("chat.completion.chunk"), "choices": choices}]
        else:
            choices = [{"index": i, "text": "", "finish_reason": r.finish_reason, "logprobs": None}
                       for i, r in enumerate(rows)]  # fmt: skip
            out = [{**self._head("text_completion"), "choices": choices}]
        opts = (self.req.model_extra or {}).get("stream_options") or {}
        if isinstance(opts, dict) and opts.get("include_usage"):
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            out.append({**self._head(obj), "choices": [], "usage": self.usage(rows)})
        out[-1]["dllm"] = _sampler_counters(counters)
        return out


def _sampler_counters(counters: dict) -> dict[str, Any]:
    """What the sampler call that answered spent (shared by the whole batch)."""
    keys = ("nfe", "steps", "tokens_committed", "tokens_per_forward", "batch_rows")
    return {k: counters[k] for k in keys if k in counters}
