"""Workers started with --api-key answer only whoever presents it: the router does (--worker-api-key), in place
of the client's own key, which stays at the router; a client that reaches a worker directly gets 401 on every
route but the probes (/health, /metrics), admin routes (/flush_cache, /abort_request) included."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.pd.conftest import Cluster, run_cluster

WORKER_KEY, CLIENT_KEY = "worker-secret-1", "client-secret-2"


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path) -> Iterator[Cluster]:
    yield from run_cluster(tiny_model_dir, worker_flags=("--api-key", WORKER_KEY),
                           router_flags=("--worker-api-key", WORKER_KEY, "--api-key", CLIENT_KEY))


def test_the_router_presents_the_worker_key(keyed: Cluster) -> None:
    client = OpenAI(base_url=keyed.router.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
    done = client.completions.create(model=client.models.list().data[0].id, prompt="hello", max_tokens=4, temperature=0)
    assert done.choices[0].finish_reason == "length"
    streamed = list(client.completions.create(model=done.model, prompt="hello", max_tokens=4, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    for path in ("/flush_cache",):
        r = httpx.post(keyed.router.url + path, headers={"Authorization": f"Bearer {CLIENT_KEY}"}, timeout=30)
        assert r.status_code == 200, r.text
    workers = httpx.get(keyed.router.url + "/workers", headers={"Authorization": f"Bearer {CLIENT_KEY}"},
                        timeout=10).json()["workers"]
    assert workers and all(w["healthy"] for w in workers), workers  # the probes got through too


def test_a_worker_refuses_clients_without_its_key(keyed: Cluster) -> None:
    for srv in (keyed.prefill, keyed.decode):
        for method, path in [("POST", "/v1/completions"), ("POST", "/flush_cache"), ("POST", "/abort_request"),
                             ("GET", "/get_load"), ("GET", "/v1/models")]:
            for auth in ({}, {"Authorization": f"Bearer {CLIENT_KEY}"}):
                r = httpx.request(method, srv.url + path, json={"prompt": "x", "rid": "x"}, headers=auth, timeout=30)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        for path in ("/health", "/metrics"):
            assert httpx.get(srv.url + path, timeout=30).status_code == 200, path
        r = httpx.post(srv.url + "/flush_cache", headers={"Authorization": f"Bearer {WORKER_KEY}"}, timeout=30)
        assert r.status_code == 200, r.text
