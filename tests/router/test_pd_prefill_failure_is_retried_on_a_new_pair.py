"""PD failures: a failing prefill fails its attempt and aborts the decode side; the router
retries on a new pair with a new room, only before the client got a byte."""
from __future__ import annotations

import time

import httpx
from harness import Cluster, sse_events
from test_pd_pairs_prefill_and_decode_with_fresh_rooms import pd_router

from tests.helpers import wait_until


def test_retryable_prefill_failure_moves_to_another_pair_with_a_new_room(cluster: Cluster) -> None:
    bad = cluster.worker("prefill", name="bad-prefill", bootstrap=True)
    good = cluster.worker("prefill", name="good-prefill", bootstrap=True)
    d = cluster.worker("decode")
    bad.control(fail_status=503, delay_s=0.05)
    r = pd_router(cluster, [bad, good], [d], "--policy", "round_robin", "--cb-failure-threshold", "0")
    for i in range(4):
        resp = httpx.post(f"{r.url}/generate", json={"text": f"q{i}", "stream": i % 2 == 1})
        assert resp.status_code == 200, resp.text
        if i % 2:
            assert sse_events(resp.text)[-1] == "[DONE]"
    bad_rooms = [q["body"]["bootstrap_room"] for q in bad.requests()]
    good_rooms = [q["body"]["bootstrap_room"] for q in good.requests()]
    assert bad_rooms, "round robin sends some first attempts to the failing prefill"
    assert not set(bad_rooms) & set(good_rooms), "a retry draws a new room"
    dec = d.requests()
    assert len(dec) == len(bad_rooms) + len(good_rooms), "decode got every attempt"
    assert sum(q["done"] for q in dec) == 4, "only the good pairs produced answers"
    assert "PD attempt failed" in r.logs()


def test_prefill_client_error_fails_the_request_and_aborts_decode(cluster: Cluster) -> None:
    p = cluster.worker("prefill", bootstrap=True)
    d = cluster.worker("decode")
    # The prefill fails without reporting the room: only the router's abort can stop decode
    # before its 30 s room deadline.
    p.control(fail_status=400, silent_failure=True)
    d.control(room_deadline_s=30)
    r = pd_router(cluster, [p], [d])
    resp = httpx.post(f"{r.url}/generate", json={"text": "x"})
    assert resp.status_code == 400
    # the prefill worker's own error document, passed through unchanged
    err = resp.json()["error"]
    assert err["type"] == "worker_error" and err["code"] == 400 and err["message"].startswith("prefill failed for room")
    assert len(p.requests()) == 1, "a 400 is not retried"
    # The decode request was cut by the router, long before its room deadline (if the router's abort beat
    # the request to the decode worker, nothing is recorded there, which is just as good).
    wait_until(lambda: all(q.get("cancelled") for q in d.requests()), 5, what="decode request aborted")
    time.sleep(0.5)  # a request still on its way would show up uncancelled now
    assert all(q.get("cancelled") for q in d.requests())


def test_all_pairs_failing_gives_an_error_not_a_partial_answer(cluster: Cluster) -> None:
    p = cluster.worker("prefill", bootstrap=True)
    d = cluster.worker("decode")
    p.control(fail_status=500)
    r = pd_router(cluster, [p], [d], "--max-retries", "2", "--cb-failure-threshold", "0")
    resp = httpx.post(f"{r.url}/generate", json={"text": "x", "stream": True})
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "worker_error"  # the last attempt's own answer, passed through
    assert len(p.requests()) == 3
    rooms = {q["body"]["bootstrap_room"] for q in p.requests()}
    assert len(rooms) == 3
    m = httpx.get(f"{r.url}/metrics").text
    assert "splitserve_router_pd_prefill_failures_total 3" in m
    assert 'splitserve_router_retries_total{route="/generate"} 2' in m


def test_prefill_failing_after_decode_started_streaming_ends_the_stream_with_an_error(cluster: Cluster) -> None:
    p = cluster.worker("prefill", bootstrap=True)
    d = cluster.worker("decode")
    r = pd_router(cluster, [p], [d])
    # The room succeeds, decode streams its first chunk and waits; then prefill answers 500.
    d.control(hold_after_first_chunk=True)
    p.control(fail_after_room_s=0.5)
    with httpx.stream("POST", f"{r.url}/generate", json={"text": "x", "stream": True}) as resp:
        assert resp.status_code == 200
        body = "".join(resp.iter_text())
    events = sse_events(body)
    assert d.name in events[0], "the first chunk had reached the client"
    assert "[DONE]" not in events
    assert "prefill broke" in events[-1] and '"code":500' in events[-1].replace(" ", "")
    assert len(p.requests()) == 1, "no retry once the client has bytes"
    wait_until(lambda: d.requests()[0].get("cancelled"), 5, what="decode stream aborted")
