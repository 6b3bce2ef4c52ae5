"""/metrics exposes the router metrics of ARCHITECTURE.md under `splitserve_router_`."""
from __future__ import annotations

import httpx
from harness import Cluster


def test_metric_names_and_labels_after_traffic(cluster: Cluster) -> None:
    a, b = cluster.worker(), cluster.worker()
    b.control(fail_status=503)
    r = cluster.router("--worker-urls", a.url, b.url, "--policy", "round_robin", "--cb-failure-threshold", "0")
    for i in range(4):
        assert httpx.post(f"{r.url}/generate", json={"text": str(i)}).status_code == 200
    httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"})
    m = httpx.get(f"{r.url}/metrics")
    assert m.headers["content-type"].startswith("text/plain")
    t = m.text
    assert f'splitserve_router_requests_total{{route="/generate",worker="{a.url}",status="200"}} 4' in t
    assert f'splitserve_router_requests_total{{route="/generate",worker="{b.url}",status="503"}}' in t
    assert 'splitserve_router_retries_total{route="/generate"}' in t
    for name in ["worker_load", "worker_healthy", "worker_circuit_open"]:
        assert f'splitserve_router_{name}{{worker="{a.url}",role="regular"}}' in t
    assert "splitserve_router_routing_decision_seconds_count 7" in t or "splitserve_router_routing_decision_seconds_count" in t
    assert 'splitserve_router_request_duration_seconds_bucket{route="/v1/completions",le="+Inf"} 1' in t
    assert "# TYPE splitserve_router_prefix_match_ratio histogram" in t
