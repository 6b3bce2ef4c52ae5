"""Health checks: a worker failing --health-failure-threshold checks in a row stops getting
requests; after --health-success-threshold good checks it is taken back."""
from __future__ import annotations

import httpx
from harness import Cluster

from tests.helpers import wait_until


def healthy(r, url: str) -> bool:
    return next(w for w in httpx.get(f"{r.url}/workers").json()["workers"] if w["url"] == url)["healthy"]


def test_failing_health_removes_then_readmits(cluster: Cluster) -> None:
    a, b = cluster.worker(), cluster.worker()
    r = cluster.router("--worker-urls", a.url, b.url, "--policy", "round_robin",
                       "--health-failure-threshold", "2", "--health-success-threshold", "2")
    a.control(health=False)
    wait_until(lambda: not healthy(r, a.url), what="a marked unhealthy")
    before = len(a.requests())
    for i in range(6):
        assert httpx.post(f"{r.url}/generate", json={"text": str(i)}).json()["worker"] == b.name
    assert len(a.requests()) == before
    assert 'splitserve_router_worker_healthy{worker="%s",role="regular"} 0' % a.url in httpx.get(f"{r.url}/metrics").text
    a.control(health=True)
    wait_until(lambda: healthy(r, a.url), what="a re-admitted")
    served = {httpx.post(f"{r.url}/generate", json={"text": str(i)}).json()["worker"] for i in range(4)}
    assert served == {a.name, b.name}


def test_dead_worker_is_taken_out_and_readiness_follows(cluster: Cluster) -> None:
    a = cluster.worker()
    r = cluster.router("--worker-urls", a.url, "--health-failure-threshold", "1")
    a.stop()
    wait_until(lambda: httpx.get(f"{r.url}/readiness").status_code == 503, what="router not ready")
    resp = httpx.post(f"{r.url}/generate", json={"text": "x"})
    assert resp.status_code == 503 and "no healthy regular worker" in resp.json()["error"]["message"]
    assert httpx.get(f"{r.url}/health").status_code == 200, "liveness is the router's own"


def test_a_worker_that_was_down_at_start_is_admitted_when_it_comes_up(cluster: Cluster) -> None:
    from harness import free_port
    port = free_port()
    a = cluster.worker()
    r = cluster.router("--worker-urls", a.url, f"http://127.0.0.1:{port}")
    assert not healthy(r, f"http://127.0.0.1:{port}")
    assert httpx.get(f"{r.url}/readiness").json()["available_workers"] == 1
