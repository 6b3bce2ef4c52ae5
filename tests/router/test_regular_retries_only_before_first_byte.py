"""Regular mode: failed attempts move to another worker, but never once the client got bytes."""
from __future__ import annotations

import httpx
from harness import Cluster, sse_events


def test_5xx_and_refused_connections_are_retried_elsewhere(cluster: Cluster) -> None:
    bad, good = cluster.worker(), cluster.worker()
    bad.control(fail_status=503)
    r = cluster.router("--worker-urls", bad.url, good.url, "--policy", "round_robin", "--cb-failure-threshold", "0")
    for i in range(4):
        resp = httpx.post(f"{r.url}/generate", json={"text": str(i)})
        assert resp.status_code == 200 and resp.json()["worker"] == good.name
    assert len(bad.requests()) >= 1
    bad.stop()
    resp = httpx.post(f"{r.url}/generate", json={"text": "after death"})
    assert resp.status_code == 200 and resp.json()["worker"] == good.name


def test_client_errors_are_passed_through_without_retry(cluster: Cluster) -> None:
    a, b = cluster.worker(), cluster.worker()
    a.control(fail_status=422)
    b.control(fail_status=422)
    r = cluster.router("--worker-urls", a.url, b.url)
    resp = httpx.post(f"{r.url}/generate", json={"text": "x"})
    assert resp.status_code == 422 and resp.json()["error"]["code"] == 422
    assert len(a.requests()) + len(b.requests()) == 1


def test_worker_dying_mid_stream_is_not_retried(cluster: Cluster) -> None:
    bad, good = cluster.worker(), cluster.worker()
    bad.control(die_mid_stream=True)
    r = cluster.router("--worker-urls", bad.url, good.url, "--policy", "round_robin")
    resp = httpx.post(f"{r.url}/generate", json={"text": "x", "stream": True})
    events = sse_events(resp.text)
    assert bad.name in events[0]
    assert "[DONE]" not in events and "stream broke" in events[-1]
    assert good.requests() == [], "bytes had reached the client: no retry"


def test_exhausted_retries_return_the_last_error(cluster: Cluster) -> None:
    a = cluster.worker()
    a.control(fail_status=500)
    r = cluster.router("--worker-urls", a.url, "--max-retries", "2", "--cb-failure-threshold", "0")
    resp = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 500
    assert "told to fail" in resp.json()["error"]["message"]
    assert len(a.requests()) == 3
