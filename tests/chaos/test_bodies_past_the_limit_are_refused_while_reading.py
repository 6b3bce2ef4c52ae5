"""A body over --max-payload-size is refused with an OpenAI-shaped 413 by the router and by every worker, for
chunked bodies too (no Content-Length to check): reading stops at the limit, so nothing past it is held and the
process's memory does not grow with what the client sends. One limit, the same default in router and workers."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deploy.process import rss_bytes
from tests.helpers import post_chunked
from tests.pd.conftest import Cluster, run_cluster, wait_pool_idle

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Path) -> Iterator[Cluster]:
    flag = ("--max-payload-size", str(LIMIT))
    yield from run_cluster(tiny_model_dir, flags=flag, router_flags=flag)


def test_chunked_bodies_past_the_limit_get_413_everywhere(limited: Cluster) -> None:
    for srv in (limited.router, limited.prefill, limited.decode, limited.colocated):
        before = rss_bytes(srv.proc.pid)
        for _ in range(3):
            status, body, sent = post_chunked(srv.url, "/v1/completions", total=200 * LIMIT)
            assert status == 413, (srv.url, status, body)
            assert body["error"]["code"] == "body_too_large" or "max-payload-size" in body["error"]["message"], body
            assert sent < 100 * LIMIT, sent  # the server stopped reading; the client could not push it all
        assert rss_bytes(srv.proc.pid) - before < 64 * LIMIT, srv.url
        # a body with Content-Length over the limit, and one under it, on the same server
        big = httpx.post(srv.url + "/v1/completions", content=b" " * (LIMIT + 1), timeout=30)
        assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error", big.text
    ok = httpx.post(limited.router.url + "/v1/completions", timeout=60,
                    content=json.dumps({"prompt": "hello", "max_tokens": 2}).encode())
    assert ok.status_code == 200, ok.text
    wait_pool_idle(limited.prefill), wait_pool_idle(limited.decode)


def test_router_and_workers_share_one_default_limit() -> None:
    from engine.config import ServerConfig
    from router import _router
    assert json.loads(_router.defaults_json())["max_payload_size"] == ServerConfig().max_payload_size == 64 << 20
