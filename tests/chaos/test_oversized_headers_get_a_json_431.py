"""A request whose head (request line and headers) is over --max-header-size is answered 431 with the usual
OpenAI-shaped JSON error, by the router and by every worker, up to far past the limit (a 1 MB header); the server
keeps serving. One limit, the same default in router and workers."""
from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from tests.pd.conftest import Cluster


def _raw(url: str, header_bytes: int) -> tuple[int, dict]:
    """Sends a GET with one header of `header_bytes` bytes over a raw socket (httpx refuses nothing, but this
    shows exactly what the server wrote back); returns the status and the parsed JSON body."""
    u = urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        head = f"GET /v1/models HTTP/1.1\r\nHost: {u.netloc}\r\nX-Big: ".encode()
        try:
            s.sendall(head + b"a" * header_bytes + b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before it read everything
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                head_part, _, rest = data.partition(b"\r\n\r\n")
                length = [ln for ln in head_part.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
                if length and len(rest) >= int(length[0].split(b":")[1]):
                    break
    status_line, _, rest = data.partition(b"\r\n")
    _, _, body = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(body)


@pytest.mark.parametrize("size", [100_000, 1_000_000], ids=["100kB", "1MB"])
def test_a_huge_header_gets_a_json_431_everywhere(cluster: Cluster, size: int) -> None:
    for srv in (cluster.router, cluster.prefill, cluster.decode, cluster.colocated):
        status, body = _raw(srv.url, size)
        assert status == 431, (srv.url, status, body)
        assert body["error"]["code"] == "header_too_large" and "max-header-size" in body["error"]["message"], body
        assert body["error"]["type"] == "invalid_request_error", body
        ok = httpx.get(srv.url + "/v1/models", headers={"X-Small": "a" * 1000}, timeout=30)
        assert ok.status_code == 200, (srv.url, ok.text)


def test_a_malformed_request_line_gets_a_json_400_from_workers(cluster: Cluster) -> None:
    for srv in (cluster.prefill, cluster.decode):
        u = urlsplit(srv.url)
        with socket.create_connection((u.hostname, u.port), timeout=30) as s:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nbad header line\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.1 400"), data[:200]
        assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "bad_http_request", data


def test_router_and_workers_share_one_default_header_limit() -> None:
    from engine.config import ServerConfig
    from router import _router
    assert json.loads(_router.defaults_json())["max_header_size"] == ServerConfig().max_header_size == 64 << 10
