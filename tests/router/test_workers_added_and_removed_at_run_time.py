"""/workers: list, add and remove at run time; a removed worker drains in-flight requests."""
from __future__ import annotations

import httpx
from harness import Cluster, background_stream, sse_events

from tests.helpers import wait_until


def test_add_then_remove_changes_where_requests_go(cluster: Cluster) -> None:
    a, b = cluster.worker(), cluster.worker()
    r = cluster.router("--worker-urls", a.url, "--policy", "round_robin")
    added = httpx.post(f"{r.url}/workers", json={"url": b.url})
    assert added.status_code == 200 and added.json()["added"]["healthy"] is True
    assert httpx.post(f"{r.url}/workers", json={"url": b.url}).status_code == 409
    for i in range(4):
        httpx.post(f"{r.url}/generate", json={"text": str(i)}).raise_for_status()
    assert len(a.requests()) == 2 and len(b.requests()) == 2
    gone = httpx.delete(f"{r.url}/workers", params={"url": a.url})
    assert gone.status_code == 200 and gone.json()["removed"] == a.url
    for i in range(3):
        httpx.post(f"{r.url}/generate", json={"text": str(i)}).raise_for_status()
    assert len(a.requests()) == 2 and len(b.requests()) == 5
    assert [w["url"] for w in httpx.get(f"{r.url}/workers").json()["workers"]] == [b.url]
    assert httpx.delete(f"{r.url}/workers", params={"url": a.url}).status_code == 400


def test_bad_worker_descriptions_are_refused(cluster: Cluster) -> None:
    a = cluster.worker()
    r = cluster.router("--worker-urls", a.url)
    assert httpx.post(f"{r.url}/workers", json={"url": "ftp://x"}).status_code == 400
    assert httpx.post(f"{r.url}/workers", json={"nope": 1}).status_code == 400
    e = httpx.post(f"{r.url}/workers", json={"url": "http://127.0.0.1:1", "role": "prefill"})
    assert e.status_code == 400 and "pd-disaggregation" in e.json()["error"]["message"]
    # SGLang's router spells the field worker_type: the same check applies
    e = httpx.post(f"{r.url}/workers", json={"url": "http://127.0.0.1:1", "worker_type": "prefill"})
    assert e.status_code == 400 and "pd-disaggregation" in e.json()["error"]["message"]


def test_a_worker_that_fails_its_first_probe_is_registered_but_not_routed_to(cluster: Cluster) -> None:
    from harness import free_port
    a = cluster.worker()
    r = cluster.router("--worker-urls", a.url, "--policy", "round_robin")
    down = f"http://127.0.0.1:{free_port()}"
    pending = httpx.post(f"{r.url}/workers", json={"url": down})
    assert pending.status_code == 202 and pending.json()["added"]["healthy"] is False, pending.text
    assert "health check" in pending.json()["message"]
    assert {w["url"]: w["healthy"] for w in httpx.get(f"{r.url}/workers").json()["workers"]} == {a.url: True,
                                                                                               down: False}
    for i in range(4):
        httpx.post(f"{r.url}/generate", json={"text": str(i)}).raise_for_status()
    assert len(a.requests()) == 4


def test_worker_type_is_accepted_for_role(cluster: Cluster) -> None:
    a, b = cluster.worker(), cluster.worker()
    r = cluster.router("--worker-urls", a.url)
    added = httpx.post(f"{r.url}/workers", json={"url": b.url, "worker_type": "regular"})
    assert added.status_code == 200 and added.json()["added"]["role"] == "regular"


def test_removed_worker_finishes_its_stream(cluster: Cluster) -> None:
    a, b = cluster.worker(), cluster.worker()
    a.control(hold_after_first_chunk=True)
    r = cluster.router("--worker-urls", a.url)
    t, result = background_stream(f"{r.url}/generate", {"text": "long", "stream": True})
    wait_until(lambda: len(a.requests()) == 1, what="stream started")
    httpx.post(f"{r.url}/workers", json={"url": b.url}).raise_for_status()
    httpx.delete(f"{r.url}/workers", params={"url": a.url}).raise_for_status()
    listed = httpx.get(f"{r.url}/workers").json()["workers"]
    assert {(w["url"], w["state"]) for w in listed} == {(b.url, "active"), (a.url, "draining")}
    for i in range(3):
        assert httpx.post(f"{r.url}/generate", json={"text": str(i)}).json()["worker"] == b.name
    a.release()
    t.join(10)
    assert sse_events(result["body"])[-1] == "[DONE]", "the in-flight stream was not cut"
    wait_until(lambda: [w["url"] for w in httpx.get(f"{r.url}/workers").json()["workers"]] == [b.url],
               what="drained worker forgotten")
