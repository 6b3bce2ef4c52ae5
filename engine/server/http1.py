"""The HTTP/1.1 protocol the workers serve: uvicorn's h11 protocol, with its errors in the API's JSON shape.

uvicorn answers a request it cannot parse (a request head over ``--max-header-size`` bytes, a malformed request
line, too many bytes before the end of the head) with a plain-text 400, whatever h11 said the status should be.
Here h11's own status hint is kept (431 for a head that is too large, 400 otherwise) and the body is the same
``{"error": {...}}`` every other error has, so clients and the router can read it. Nothing else changes: the
connection closes after the answer, as before.
"""
from __future__ import annotations

import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.server.errors import error_body


class _Connection(h11.Connection):
    """An h11 connection that remembers the last protocol error it raised (uvicorn drops the exception)."""

    last_error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.last_error = e
            raise


class JsonErrorsH11Protocol(H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = self.config.h11_max_incomplete_event_size
        self.conn = _Connection(h11.SERVER, limit) if limit is not None else _Connection(h11.SERVER)

    def send_400_response(self, msg: str) -> None:
        error = getattr(self.conn, "last_error", None)
        status = getattr(error, "error_status_hint", 400) or 400
        if status == 431:
            limit = self.config.h11_max_incomplete_event_size
            body = error_body(431, f"request headers over {limit} bytes (--max-header-size)", "header_too_large")
        else:
            body = error_body(400, f"malformed HTTP request: {error or msg}", "bad_http_request")
        payload = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(payload)).encode())]
        out = self.conn.send(h11.Response(status_code=status, headers=headers)) or b""
        out += (self.conn.send(h11.Data(data=payload)) or b"") + (self.conn.send(h11.EndOfMessage()) or b"")
        self.transport.write(out)
        self.transport.close()
