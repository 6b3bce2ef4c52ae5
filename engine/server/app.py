"""The FastAPI application: the HTTP surface of ARCHITECTURE.md over a ServingContext. Worker roles build
the same app and add their own routes."""
from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.config import ServerConfig
from engine.sampling_params import SamplingParams
from engine.server import generate_api, openai_api, tokenize_api
from engine.server.errors import error_response, install_error_handlers
from engine.server.openapi import install_openapi
from engine.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerateRequest,
                                    TokenizeRequest)
from engine.server.serving import ServingContext, collect

OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


def build_app(ctx: ServingContext, server_cfg: ServerConfig,
              on_start: Callable[[], Awaitable[None]] | None = None,
              on_stop: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        if on_start is not None:
            await on_start()
        yield
        if on_stop is not None:
            await on_stop()
        await ctx.engine.shutdown()

    app = FastAPI(title="SplitServe", lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    install_openapi(app, api_key=server_cfg.api_key is not None)

    app.add_middleware(GuardMiddleware, api_key=server_cfg.api_key, max_body=server_cfg.max_payload_size,
                       max_head=server_cfg.max_header_size)

    @app.get("/health")
    async def health() -> Response:
        if not ctx.engine.alive:
            return error_response(503, "the engine thread is not running", "engine_dead")
        if ctx.engine.stalled:
            return error_response(503, f"the engine's current step has run for {ctx.engine.stalled_for:.0f}s "
                                       f"(--stall-timeout-secs {ctx.engine.stall_timeout:g})", "engine_stalled")
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate(request: HTTPRequest) -> Response:
        req = ctx.core.make_request([ctx.core.arch.bos_token_id or 0], SamplingParams(max_new_tokens=1),
                                    rid=f"health-{time.monotonic_ns()}", detokenize=False)
        try:
            await asyncio.wait_for(collect(request, ctx, [req]), server_cfg.health_generate_timeout)
        except asyncio.TimeoutError:
            return error_response(503, f"no token within {server_cfg.health_generate_timeout}s", "unhealthy")
        return JSONResponse({"status": "ok"})

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(ctx.started), "owned_by": "splitserve",
                "root": str(ctx.core.source.path), "max_model_len": ctx.core.context_length}

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card(n) for n in ctx.core.served_model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id not in ctx.core.served_model_names:
            return error_response(404, f"model {model_id!r} is not served here; this server serves "
                                       f"{ctx.core.served_model_name!r}", "model_not_found", "model")
        return JSONResponse(model_card(model_id))

    @app.get("/get_model_info")
    async def model_info() -> Response:
        core = ctx.core
        return JSONResponse({"model_path": str(core.source.path), "tokenizer_path": str(core.model_dir),
                             "served_model_name": core.served_model_name,
                             "architecture": core.arch.architecture, "is_generation": True,
                             "context_length": core.context_length, "vocab_size": core.arch.vocab_size,
                             "dtype": str(core.dtype).replace("torch.", "")})

    @app.get("/get_server_info")
    async def server_info() -> Response:
        core = ctx.core
        return JSONResponse({
            "role": ctx.role, "version": _version(), "uptime_s": time.time() - ctx.started,
            "model": model_dict(core.cfg.model), "cache": model_dict(core.cfg.cache),
            "scheduler": model_dict(core.cfg.scheduler), "device": str(core.device),
            "kv_pages_total": core.allocator.capacity, "page_size": core.kv_shape.page_size,
            "context_length": core.context_length, "load": ctx.engine.load(),
            "hicache": core.hicache.describe() if core.hicache is not None else None})

    @app.get("/get_load", include_in_schema=False)  # for routers and tests; not proxied (docs/api.md)
    async def get_load() -> Response:
        return JSONResponse(ctx.engine.load())

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        flushed = await ctx.engine.call(lambda core: core.flush_cache())
        return JSONResponse({"flushed_tokens": flushed})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        return await openai_api.create_completion(body, request, ctx)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        return await openai_api.create_chat_completion(body, request, ctx)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: HTTPRequest) -> Response:
        return await generate_api.generate(body, request, ctx)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await tokenize_api.tokenize(body, ctx)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await tokenize_api.detokenize(body, ctx)

    @app.post("/abort_request", include_in_schema=False)  # by request id, on the worker itself (docs/api.md)
    async def abort_request(request: HTTPRequest) -> Response:
        try:
            data = await request.json()
        except ValueError:
            data = None
        rid = data.get("rid") if isinstance(data, dict) else None
        if not isinstance(rid, str):
            return error_response(400, "body must be {\"rid\": \"...\"}", "invalid_request", "rid")
        ctx.engine.abort(rid)
        return JSONResponse({"rid": rid, "aborted": True})

    return app


class GuardMiddleware:
    """Pure ASGI (so streaming and disconnect detection pass straight through): refuses oversized heads (431;
    h11 bounds only a head that arrives in pieces, engine/server/http1.py) and bodies (413) and missing API keys
    (401), and treats every POST body as JSON whatever its content-type says (curl -d).

    A body without Content-Length (chunked) is read here, counting, and refused as soon as it passes the limit,
    so nothing past the limit is ever held; what was read is then handed to the app as one message."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int, max_head: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body, self.max_head = max_body, max_head

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = len(scope.get("raw_path") or b"") + len(scope["query_string"]) + sum(
            len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > self.max_head:
            await error_response(431, f"request headers over {self.max_head} bytes (--max-header-size)",
                                 "header_too_large")(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body:
            await self._too_large(scope, receive, send)
            return
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                await error_response(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                                     "invalid_api_key")(scope, receive, send)
                return
        if scope["method"] == "POST" and b"json" not in headers.get(b"content-type", b""):
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k != b"content-type"] + [
                (b"content-type", b"application/json")]
        if not length.isdigit() and scope["method"] in ("POST", "PUT", "PATCH"):
            body = await _read_bounded(receive, self.max_body)
            if body is None:  # over the limit (or the client left): answer now, read no further
                await self._too_large(scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(413, f"request body over {self.max_body} bytes (--max-payload-size)",
                             "body_too_large")(scope, receive, send)


async def _read_bounded(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it passes `limit` bytes or the client disconnects."""
    parts, total = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that yields `body` once, then defers to the real one (for disconnects)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay  # type: ignore[return-value]


def model_dict(cfg: object) -> dict:
    import dataclasses
    return dataclasses.asdict(cfg)  # type: ignore[call-overload]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("splitserve")
    except PackageNotFoundError:
        return "dev"
