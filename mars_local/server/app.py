"""The ASGI app of ``mars serve`` (FastAPI, streaming with sse-starlette).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``stream: true`` as server-sent events in OpenAI's chunk format),
``GET /v1/models``, ``GET /health``, ``GET /metrics``.  Every error is OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``; nothing a client
sends can stop the server (the generation thread catches everything).

Browsers are kept out unless the user lets them in (:class:`_Guard`, before
everything else): a request with an ``Origin`` not in ``--cors`` is refused
(403), so a web page cannot make a local server generate for it, and while
the server listens on loopback a ``Host`` that is not a loopback name or one
the user allowed is refused (403), so a DNS-rebinding page cannot read its
answers.  POST bodies must be sent as ``application/json`` (415 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..core.config import GenerateConfig
from ..core.defaults import DEFAULTS
from . import GRACEFUL_SHUTDOWN_S, host_name, is_loopback
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .requests import ApiError, Request, parse_chat, parse_completion
from .responses import ResponseMaker, cached_tokens
from .worker import Job, Worker

__all__ = ["ServerSettings", "create_app", "MAX_BODY"]

MAX_BODY = 8 << 20  # bytes: far more text than any context holds
# seconds a stream in flight may take to end on its own once the server exits (then
# sse-starlette cuts it): within uvicorn's grace even when sse-starlette sees the exit 0.5 s late
STREAM_SHUTDOWN_GRACE_S = GRACEFUL_SHUTDOWN_S - 1.0
_DRAIN_LIMIT = 256 << 20  # a larger body is not even read to the end (the connection is closed)
_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/v1/health", "/metrics")


@dataclass
class ServerSettings:
    """What ``mars serve``'s flags decide for every request."""

    defaults: GenerateConfig  # each request's fields go over these
    model_id: str  # what /v1/models lists and requests name
    aliases: tuple[str, ...] = ()  # other names a request's `model` may use (file name, registry name)
    api_key: str | None = None
    queue_size: int = DEFAULTS.queue_size  # requests waiting for the engine before 503
    log: bool = True  # one line per generation on stderr
    info: dict = field(default_factory=dict)  # extra /v1/models fields (drafter, verify)
    cors: tuple[str, ...] = ()  # browser origins allowed to call the API ("*": any); none by default
    host: str = "127.0.0.1"  # the address listened on: on loopback, Host headers are checked
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides loopback ones (checked whenever given)
    parallel: int = 1  # requests decoded together (1: one at a time, with the engine's prefix cache)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


class _Guard:
    """ASGI middleware: the browser and DNS-rebinding checks (the module docstring), then
    the media type of POST bodies; each refusal in OpenAI's error shape."""

    def __init__(self, app, settings: ServerSettings):
        self.app = app
        self.cors = {o.lower() for o in settings.cors}
        self.check_host = is_loopback(host_name(settings.host)) or bool(settings.allowed_hosts)
        self.hosts = {host_name(settings.host), *(host_name(h) for h in settings.allowed_hosts)}

    def refusal(self, scope) -> ApiError | None:
        headers = Headers(scope=scope)
        host = headers.get("host")
        if self.check_host and host is not None and not self.host_allowed(host):
            return ApiError(403, f"the Host {host!r} is not a name of this server (a DNS-rebinding page?); "
                            "start the server with --allowed-host NAME to accept it",
                            type="permission_error", code="host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and "*" not in self.cors and origin.lower() not in self.cors:
            return ApiError(403, f"requests from web pages on {origin!r} are not allowed; start the server with "
                            "--cors ORIGIN to let a page call it from a browser",
                            type="permission_error", code="origin_not_allowed")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").partition(";")[0].strip().lower()
            if kind != "application/json":
                return ApiError(415, "the request body must be JSON sent with 'Content-Type: application/json', "
                                f"got {kind or 'no Content-Type'}", code="unsupported_media_type")
        return None

    def host_allowed(self, host: str) -> bool:
        name = host_name(host)
        return name in self.hosts or is_loopback(name)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (exc := self.refusal(scope)) is not None:
            return await _error(exc)(scope, receive, send)
        return await self.app(scope, receive, send)


class _CountRequests:
    """ASGI middleware: every HTTP answer counted by endpoint and status (streams at their end)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            self.metrics.requests.labels(path if path in _ENDPOINTS else "other", str(status[0])).inc()


class _Server:
    """The routes' shared state: the engine's worker, the metrics, the settings."""

    def __init__(self, engine, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        self.metrics = Metrics()
        if settings.parallel > 1:
            from .batch_worker import BatchWorker

            self.worker = BatchWorker(engine, settings.queue_size, settings.parallel, on_done=self._done,
                                      defaults=settings.defaults)
        else:
            self.worker = Worker(engine, settings.queue_size, on_done=self._done)
        self.names = {settings.model_id, *settings.aliases}

    # ------------------------------------------------------------ checks
    def auth(self, request: HttpRequest) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "invalid API key: send 'Authorization: Bearer <key>' with the server's --api-key",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, model: str | None) -> None:
        if model and model not in self.names:
            raise ApiError(404, f"the model {model!r} does not exist on this server; it serves "
                           f"{self.settings.model_id!r}", param="model", code="model_not_found")

    def check_size(self, req: Request) -> None:
        """Prompts that cannot fit, refused before they wait for the engine: every chat
        message renders to at least one token (in any real template), a token id is one."""
        n_ctx = self.engine.n_ctx
        if req.kind == "chat" and len(req.messages) >= n_ctx:
            raise ApiError(400, f"the request has {len(req.messages)} messages but the context holds {n_ctx} "
                           "tokens, and every message takes at least one; send fewer messages or start the "
                           "server with a larger -c", param="messages", code="context_length_exceeded")
        if isinstance(req.prompt, list) and len(req.prompt) >= n_ctx:
            raise ApiError(400, f"the prompt is {len(req.prompt)} tokens but the context holds {n_ctx}; shorten it "
                           "or start the server with a larger -c", param="prompt", code="context_length_exceeded")

    @staticmethod
    async def body(request: HttpRequest):
        """The request's JSON (at most MAX_BODY bytes: 413 beyond, after draining what was sent)."""
        size, parts, too_big = 0, [], False
        try:
            async for part in request.stream():
                size += len(part)
                if size > MAX_BODY:
                    too_big = True
                    parts = []
                    if size > _DRAIN_LIMIT:
                        break
                elif not too_big:
                    parts.append(part)
        except ClientDisconnect:
            raise ApiError(499, "the client closed the request", code="client_closed") from None
        if too_big:
            raise ApiError(413, f"the request body is over {MAX_BODY >> 20} MiB", code="request_too_large")
        raw = b"".join(parts)
        try:
            return json.loads(raw, parse_constant=_no_constants)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None

    # ------------------------------------------------------- generations
    async def generate(self, request: HttpRequest, parse, endpoint: str):
        self.auth(request)
        req: Request = parse(await self.body(request), self.settings.defaults)
        self.check_model(req.model)
        self.check_size(req)
        job = Job(req, asyncio.get_running_loop(), endpoint)
        self.worker.submit(job)  # 503 when the queue is full
        self.metrics.queue_depth.set(self.worker.waiting)
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        maker = ResponseMaker(req.kind, self.settings.model_id, f"{prefix}-{uuid.uuid4().hex[:24]}",
                              req.n_top, req.logprobs)
        kind, value = await self._next(job, request)  # "start" or "error"
        if kind == "error":
            raise value
        if req.stream:
            # sse-starlette cuts a stream once it sees the server exiting; the grace lets ours end
            # with its 503 error event first (run_server's on_shutdown cancels the generations)
            return EventSourceResponse(self._events(job, maker, req), ping=15,
                                       shutdown_grace_period=STREAM_SHUTDOWN_GRACE_S)
        return JSONResponse(await self._collect(job, maker, request))

    async def _next(self, job: Job, request: HttpRequest | None = None):
        """The job's next event; a client that went away meanwhile (checked every
        quarter second while events come, too) cancels it."""
        while True:
            if request is not None and time.monotonic() - job.checked > 0.25:
                job.checked = time.monotonic()
                if await request.is_disconnected():
                    job.cancel()
                    raise ApiError(499, "the client closed the request", code="client_closed")
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                continue

    async def _collect(self, job: Job, maker: ResponseMaker, request: HttpRequest) -> dict:
        text, lps = [], []
        while True:
            kind, value = await self._next(job, request)
            if kind == "error":
                raise value
            if kind == "done":
                lp = lps if job.request.logprobs else None
                if job.tool_format is not None:
                    return maker.complete_tools("".join(text), job.tool_format, lp, value)
                return maker.complete("".join(text), lp, value)
            chunk, pieces = value
            text.append(chunk.text)
            if chunk.logprobs:
                lps.extend(chunk.logprobs)
                maker.add_pieces(pieces)

    async def _events(self, job: Job, maker: ResponseMaker, req: Request):
        """The SSE events of a stream; leaving early (the client went away) cancels the job."""
        try:
            first = maker.first()
            if first is not None:
                yield {"data": json.dumps(first)}
            calls = None  # the tool-call parser, when the answer may hold calls
            if job.tool_format is not None:
                from ..chat.tools import StreamingToolParser, was_cut

                calls = StreamingToolParser(job.tool_format)
            while True:
                kind, value = await self._next(job)
                if kind == "error":
                    yield {"data": json.dumps(value.body())}
                    break
                if kind == "done":
                    if calls is not None:
                        for c in maker.tool_chunks(calls.finish(cut=was_cut(value.stop_reason))):
                            yield {"data": json.dumps(c)}
                    yield {"data": json.dumps(maker.last(value))}
                    if req.include_usage:
                        yield {"data": json.dumps(maker.usage_chunk(value))}
                    break
                chunk, pieces = value
                if calls is not None:  # (log probabilities are not streamed with tool calls)
                    for c in maker.tool_chunks(calls.feed(chunk.text)):
                        yield {"data": json.dumps(c)}
                elif chunk.text or chunk.logprobs:
                    maker.add_pieces(pieces)
                    yield {"data": json.dumps(maker.piece_chunk(chunk.text, chunk.logprobs))}
                job.sent()  # (the generator resumes once the chunk is written)
            yield {"data": "[DONE]"}
        finally:
            job.cancel()  # no-op when it had finished

    def _done(self, job: Job, outcome: str) -> None:
        """On the worker thread, when a job ends: metrics and the log line."""
        now = time.monotonic()
        started = job.t_start is not None and job.stats is not None
        self.metrics.observe(job.stats if started else None, outcome,
                             now - job.t_submit if started else None,
                             job.t_first - job.t_submit if job.t_first is not None else None)
        self.metrics.queue_depth.set(self.worker.waiting)
        if self.settings.log and started:
            s = job.stats
            line = (f"mars serve: #{job.number} {job.endpoint} {outcome}: prompt {s.n_prompt} "
                    f"(cached {cached_tokens(s)}), generated {s.n_generated} in {s.n_rounds} "
                    f"rounds (tau {s.mean_accepted_length:.2f}), {now - job.t_submit:.2f} s, {s.stop_reason}")
            if job.rounds_at_cancel is not None and outcome == "cancelled":
                line += f"; {s.n_rounds - job.rounds_at_cancel} round(s) after the client left"
            print(line, file=sys.stderr, flush=True)


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def create_app(engine, settings: ServerSettings) -> FastAPI:
    """The app over a loaded engine (:class:`~mars_local.speculate.engine.Engine`, or a test double)."""
    srv = _Server(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        srv.worker.stop()  # cancel what runs and waits

    app = FastAPI(title="mars-local", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = srv
    _add_error_handlers(app)
    _add_routes(app, srv, settings)
    if settings.cors:  # web pages on these origins may call the API from a browser
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    app.add_middleware(_Guard, settings=settings)  # outside CORS: a foreign origin's preflight is refused too
    app.add_middleware(_CountRequests, metrics=srv.metrics)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error is an OpenAI-style JSON error body; an unexpected one is also a line on stderr."""

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind))

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        print(f"mars serve: {request.url.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return _error(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))


def _add_routes(app: FastAPI, srv: _Server, settings: ServerSettings) -> None:
    """The OpenAI-compatible endpoints, the model cards, /health and /metrics."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await srv.generate(request, parse_chat, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await srv.generate(request, parse_completion, "/v1/completions")

    def card() -> dict:
        return {"id": settings.model_id, "object": "model", "created": int(time.time()), "owned_by": "mars-local",
                **settings.info}

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        srv.auth(request)
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: HttpRequest):
        srv.auth(request)
        srv.check_model(model_id)
        return card()

    @app.get("/health")
    @app.get("/v1/health")
    async def health():
        return {"status": "ok", "queue": srv.worker.waiting, "running": srv.worker.running is not None,
                "sequences": srv.worker.n_running}

    @app.get("/metrics")
    async def metrics(request: HttpRequest):
        srv.auth(request)
        srv.metrics.queue_depth.set(srv.worker.waiting)
        srv.metrics.set_load(srv.worker)
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

