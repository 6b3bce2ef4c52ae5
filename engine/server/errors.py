"""OpenAI-style JSON errors: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineDead, EngineOverloaded, EngineStalled
from engine.sampling_params import InvalidRequestError
from engine.server.protocol import UnencodableText

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 431: "invalid_request_error", 500: "server_error",
          503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code or str(status)}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)


def sse_error(status: int, message: str, code: str | None = None) -> str:
    return f"data: {json.dumps(error_body(status, message, code))}\n\n"


async def sse_guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events; a stalled engine ends it with an error event (never a silent cut or a normal end)."""
    try:
        async for event in events:
            yield event
    except EngineStalled as e:
        yield sse_error(503, str(e), "engine_stalled")


def _describe(errors: list) -> str:
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}"
        msg = e.get("msg")
        if e.get("type") == "extra_forbidden":
            msg = "is not a field we know; it would be ignored, so it is refused (see docs/api.md for what we accept)"
        parts.append(f"{loc or 'body'}: {msg}")
    return "invalid request: " + "; ".join(parts)


def _param(errors: list) -> str | None:
    """The first offending field's name (``messages.0.role`` style), for the error's ``param``."""
    for e in errors[:1]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if loc and e.get("type") != "json_invalid":
            return ".".join(loc)
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.code, e.param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(e), e.code, e.param)

    @app.exception_handler(UnencodableText)
    async def _unencodable(_: Request, e: UnencodableText) -> JSONResponse:
        return error_response(400, str(e), "invalid_text", e.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = list(e.errors())
        return error_response(400, _describe(errors), "invalid_request", _param(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        r = error_response(e.status_code, str(e.detail))  # keeps e.g. the Allow header of a 405
        r.headers.update(e.headers or {})
        return r

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(_: Request, e: EngineOverloaded) -> JSONResponse:
        return error_response(503, str(e), "overloaded")

    @app.exception_handler(EngineStalled)
    async def _stalled(_: Request, e: EngineStalled) -> JSONResponse:
        return error_response(503, str(e), "engine_stalled")

    @app.exception_handler(EngineDead)
    async def _dead(_: Request, e: EngineDead) -> JSONResponse:
        return error_response(503, str(e), "engine_dead")

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, f"internal error: {type(e).__name__}", "internal_error")
