"""The served OpenAPI document, made to say what the server does: validation errors are 400s (FastAPI would
document 422), every error has the OpenAI error shape, inference routes may stream ``text/event-stream``,
``/metrics`` is Prometheus text, and each route lists the statuses it can answer with."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "integer", "null"]}}}},
}
INFERENCE = ("/v1/completions", "/v1/chat/completions", "/generate")
_DESCRIPTIONS = {400: "invalid request (the error names the field)", 401: "missing or wrong API key",
                 404: "not found", 405: "method not allowed", 413: "body too large",
                 500: "the request failed while running (the error names the stage)",
                 503: "overloaded, shutting down, or not ready", 504: "no answer in time"}


def _errors(*statuses: int) -> dict[str, Any]:
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(s): {"description": _DESCRIPTIONS[s], "content": ref} for s in statuses}


def install_openapi(app: FastAPI, api_key: bool) -> None:
    def build() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        doc.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
        for schemas in ("HTTPValidationError", "ValidationError"):
            doc["components"]["schemas"].pop(schemas, None)
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                responses = op["responses"]
                responses.pop("422", None)
                statuses = [405] + ([401] if api_key and path not in ("/health", "/health_generate", "/metrics")
                                    else [])
                if method == "post":
                    statuses += [400, 413]
                if path in INFERENCE:
                    statuses += [500, 503]
                    responses["200"]["content"]["text/event-stream"] = {"schema": {"type": "string"}}
                if path.startswith("/v1/models/"):
                    statuses.append(404)
                if path == "/health_generate":
                    statuses.append(503)
                if path == "/metrics":
                    responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
                responses.update(_errors(*sorted(set(statuses))))
        abort = doc["paths"].get("/abort_request", {}).get("post")
        if abort is not None:
            abort["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["rid"], "properties": {"rid": {"type": "string"}}}}}}
        app.openapi_schema = doc
        return doc
    app.openapi = build  # type: ignore[method-assign]
