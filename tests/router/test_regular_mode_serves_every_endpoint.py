"""Regular mode: every public endpoint answers through the router, with x-request-id carried."""
from __future__ import annotations

import httpx
import openai
from harness import Cluster, sse_events


def test_inference_routes_streamed_and_not(cluster: Cluster) -> None:
    w1, w2 = cluster.worker(), cluster.worker()
    r = cluster.router("--worker-urls", w1.url, w2.url, "--policy", "round_robin")
    g = httpx.post(f"{r.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4}})
    assert g.status_code == 200 and g.json()["worker"] in (w1.name, w2.name)
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused")
    c = client.completions.create(model="fake-model", prompt="hello", max_tokens=4)
    assert c.choices[0].text.split(":")[0] in (w1.name, w2.name)
    chat = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hey"}])
    assert chat.choices[0].message.content
    pieces = [ch.choices[0].delta.content for ch in client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hey"}], stream=True) if ch.choices[0].delta.content]
    assert len(pieces) == 4 and pieces[0].endswith("#0 ")
    streamed = [ch.choices[0].text for ch in client.completions.create(model="fake-model", prompt="x", stream=True)]
    assert len(streamed) == 4
    s = httpx.post(f"{r.url}/generate", json={"text": "hi", "stream": True})
    ev = sse_events(s.text)
    assert ev[-1] == "[DONE]" and len(ev) == 5
    assert s.headers["content-type"].startswith("text/event-stream")


def test_info_health_and_admin_routes(cluster: Cluster) -> None:
    w1, w2 = cluster.worker(), cluster.worker()
    r = cluster.router("--worker-urls", w1.url, w2.url)
    models = openai.OpenAI(base_url=f"{r.url}/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert httpx.get(f"{r.url}/get_model_info").json()["model_path"] == "fake-model"
    assert httpx.get(f"{r.url}/get_server_info").json()["role"] == "regular"
    assert httpx.get(f"{r.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{r.url}/readiness").json()["available_workers"] == 2
    hg = httpx.get(f"{r.url}/health_generate")
    assert hg.status_code == 200 and hg.json()["workers"][0] in (w1.url, w2.url)
    f = httpx.post(f"{r.url}/flush_cache")
    assert f.status_code == 200 and sorted(f.json()["flushed"]) == sorted([w1.url, w2.url])
    assert w1.state()["flushes"] == 1 and w2.state()["flushes"] == 1
    listed = httpx.get(f"{r.url}/workers").json()["workers"]
    assert {w["url"] for w in listed} == {w1.url, w2.url} and all(w["healthy"] for w in listed)
    nf = httpx.get(f"{r.url}/nope")
    assert nf.status_code == 404 and nf.json()["error"]["code"] == "not_found"


def test_request_id_is_propagated_or_generated(cluster: Cluster) -> None:
    w = cluster.worker()
    r = cluster.router("--worker-urls", w.url)
    given = httpx.post(f"{r.url}/generate", json={"text": "a"}, headers={"x-request-id": "req-abc-123"})
    assert given.headers["x-request-id"] == "req-abc-123"
    made = httpx.post(f"{r.url}/generate", json={"text": "b"})
    rid = made.headers["x-request-id"]
    assert len(rid) == 16
    seen = [{k.lower(): v for k, v in q["headers"].items()}.get("x-request-id") for q in w.requests()]
    assert seen == ["req-abc-123", rid]
    assert "request_id" in r.logs() and "req-abc-123" in r.logs()


def test_bad_json_is_a_400_with_an_error_document(cluster: Cluster) -> None:
    w = cluster.worker()
    r = cluster.router("--worker-urls", w.url)
    bad = httpx.post(f"{r.url}/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    assert w.requests() == []
