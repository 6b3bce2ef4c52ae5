"""Circuit breaker: consecutive request failures open it (no traffic while open, although
health checks pass); after the cool-down one trial request goes through, and successes close it."""
from __future__ import annotations

import httpx
from harness import Cluster

from tests.helpers import wait_until


def circuit(r, url: str) -> str:
    return next(w for w in httpx.get(f"{r.url}/workers").json()["workers"] if w["url"] == url)["circuit"]


def test_breaker_opens_on_failures_and_closes_after_recovery(cluster: Cluster) -> None:
    a, b = cluster.worker(), cluster.worker()
    a.control(fail_status=500)
    r = cluster.router("--worker-urls", a.url, b.url, "--policy", "round_robin",
                       "--cb-failure-threshold", "2", "--cb-success-threshold", "1", "--cb-timeout-secs", "1.5",
                       "--max-retries", "1")
    for i in range(4):
        assert httpx.post(f"{r.url}/generate", json={"text": str(i)}).status_code == 200
    assert circuit(r, a.url) == "open"
    hits = len(a.requests())
    for i in range(6):
        assert httpx.post(f"{r.url}/generate", json={"text": str(i)}).json()["worker"] == b.name
    assert len(a.requests()) == hits, "no request reaches an open circuit"
    assert 'splitserve_router_worker_circuit_open{worker="%s",role="regular"} 1' % a.url in httpx.get(f"{r.url}/metrics").text
    a.control(fail_status=None)

    def recovered() -> bool:
        httpx.post(f"{r.url}/generate", json={"text": "probe"})
        return circuit(r, a.url) == "closed"

    wait_until(recovered, 10, step=0.3, what="circuit closed again")
    served = {httpx.post(f"{r.url}/generate", json={"text": str(i)}).json()["worker"] for i in range(4)}
    assert served == {a.name, b.name}
    logs = r.logs()  # both transitions are logged, naming the worker
    assert "circuit breaker opened" in logs and "circuit breaker closed" in logs and a.url in logs
