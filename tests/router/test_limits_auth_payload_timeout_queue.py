"""Limits: API key (401), body size (413), request timeout (504), and the bounded queue of the
concurrency limit (429 when full, 408 after waiting too long)."""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest
from harness import Cluster

from tests.helpers import wait_until


def test_api_key_is_required_except_for_liveness(cluster: Cluster) -> None:
    w = cluster.worker()
    r = cluster.router("--worker-urls", w.url, "--api-key", "s3cret", ready=False)
    assert httpx.get(f"{r.url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        resp = httpx.post(f"{r.url}/generate", json={"text": "x"}, headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{r.url}/workers").status_code == 401
    ok = httpx.post(f"{r.url}/generate", json={"text": "x"}, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="s3cret")
    assert client.completions.create(model="fake-model", prompt="x").choices[0].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{r.url}/v1", api_key="nope").completions.create(model="m", prompt="x")


def test_the_api_key_can_come_from_the_environment_or_a_file(cluster: Cluster) -> None:
    """A secret need not be on the command line, where every user of the host can read it."""
    w = cluster.worker()
    key_file = cluster.tmp / "router.key"
    key_file.write_text("from-a-file\n")
    for r, key in ((cluster.router("--worker-urls", w.url, ready=False, env={"SPLITSERVE_ROUTER_API_KEY": "from-env"}),
                    "from-env"),
                   (cluster.router("--worker-urls", w.url, "--api-key-file", str(key_file), ready=False),
                    "from-a-file")):
        assert httpx.post(f"{r.url}/generate", json={"text": "x"}).status_code == 401
        ok = httpx.post(f"{r.url}/generate", json={"text": "x"}, headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200, ok.text
        assert key not in " ".join(r.popen.args)


def test_oversized_body_is_refused_before_reaching_a_worker(cluster: Cluster) -> None:
    w = cluster.worker()
    r = cluster.router("--worker-urls", w.url, "--max-payload-size", "1000")
    resp = httpx.post(f"{r.url}/generate", json={"text": "x" * 2000})
    assert resp.status_code == 413 and "max-payload-size" in resp.json()["error"]["message"]
    chunked = httpx.post(f"{r.url}/generate", content=iter([b'{"text": "', b"y" * 1500, b'"}']))
    assert chunked.status_code == 413
    assert w.requests() == []
    assert httpx.post(f"{r.url}/generate", json={"text": "small"}).status_code == 200


def test_slow_worker_times_out_with_504(cluster: Cluster) -> None:
    w = cluster.worker()
    w.control(delay_s=5)
    r = cluster.router("--worker-urls", w.url, "--request-timeout-secs", "0.5")
    resp = httpx.post(f"{r.url}/generate", json={"text": "x"}, timeout=10)
    assert resp.status_code == 504 and resp.json()["error"]["type"] == "timeout_error"


def test_full_queue_gives_429_and_long_wait_gives_408(cluster: Cluster) -> None:
    w = cluster.worker()
    w.control(delay_s=1.5)
    r = cluster.router("--worker-urls", w.url, "--max-concurrent-requests", "1", "--queue-size", "1",
                       "--queue-timeout-secs", "0.5")
    with cf.ThreadPoolExecutor(3) as pool:
        first = pool.submit(httpx.post, f"{r.url}/generate", json={"text": "1"}, timeout=10)
        wait_until(lambda: len(w.requests()) == 1, what="first request at the worker")
        queued = pool.submit(httpx.post, f"{r.url}/generate", json={"text": "2"}, timeout=10)
        wait_until(lambda: "splitserve_router_queued_requests 1" in httpx.get(f"{r.url}/metrics").text,
                   what="second request queued")
        refused = httpx.post(f"{r.url}/generate", json={"text": "3"}, timeout=10)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        assert queued.result().status_code == 408
        assert first.result().status_code == 200
    m = httpx.get(f"{r.url}/metrics").text
    assert 'splitserve_router_rejected_total{reason="queue_full"} 1' in m
    assert 'splitserve_router_rejected_total{reason="queue_timeout"} 1' in m
