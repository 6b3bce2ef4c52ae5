"""The cluster token: a shared secret every bootstrap gRPC call carries (metadata ``x-splitserve-cluster-token``),
checked by the prefill side's server in constant time. A decode worker that presents no token or a wrong one is
refused with UNAUTHENTICATED before any handler runs, so it learns nothing about rooms or layouts and gets no
transport session to write through. An empty token on the prefill side means the server is open (the default
for single-host use; ``splitserve up`` sets one anyway).

The token comes from ``--cluster-token``, ``$SPLITSERVE_CLUSTER_TOKEN`` or ``--cluster-token-file`` (the last two
keep it out of the process list)."""
from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from kv_transfer.wire.errors import ConfigError

TOKEN_HEADER = "x-splitserve-cluster-token"
TOKEN_ENV = "SPLITSERVE_CLUSTER_TOKEN"


def resolve_token(value: str, file: str) -> str:
    """The token from the flag, else the environment, else the file ('' when none is given)."""
    if value:
        return value
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if not file:
        return ""
    try:
        token = Path(file).read_text().strip()
    except OSError as e:
        raise ConfigError(f"--cluster-token-file {file}: {e.strerror}") from None
    if not token:
        raise ConfigError(f"--cluster-token-file {file} is empty")
    return token


class TokenCheck(grpc.ServerInterceptor):
    """Server side: refuse every call whose metadata lacks the token."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        given = dict(details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._token):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None

        def deny(_request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong cluster token; give every worker the same --cluster-token")
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)


class _CallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, base: Any, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready, self.compression = base.wait_for_ready, base.compression
        self.metadata = metadata


class TokenSender(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Client side: add the token to every call."""

    def __init__(self, token: str) -> None:
        self._token = token

    def _with_token(self, details: Any) -> _CallDetails:
        return _CallDetails(details, [*(details.metadata or ()), (TOKEN_HEADER, self._token)])

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)
