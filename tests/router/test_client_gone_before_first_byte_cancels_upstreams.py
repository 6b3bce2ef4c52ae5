"""A client that goes away while the router still waits for the worker's first byte: the router
notices (it watches the client connection while the upstream is pending) and drops its upstream
requests at once, in PD mode both the decode and the prefill request. The stand-in workers record
a request as cancelled when its connection closes before they answered."""
from __future__ import annotations

import json
import socket

from harness import Cluster
from test_pd_pairs_prefill_and_decode_with_fresh_rooms import pd_router

from tests.helpers import wait_until


def send_and_hold(url: str, body: dict) -> socket.socket:
    """POSTs on a raw socket (an HTTP client would block until the response head) and returns it open."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall((f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(raw)}\r\n\r\n{raw}").encode())
    return sock


def test_pd_client_gone_while_prefill_runs_cancels_prefill_and_decode(cluster: Cluster) -> None:
    p = cluster.worker("prefill", bootstrap=True)
    d = cluster.worker("decode")
    # A long prefill (20 s) and a decode side that would wait as long for it: only the router
    # dropping both requests ends them within the test's few seconds.
    p.control(delay_s=20)
    d.control(room_deadline_s=30)
    r = pd_router(cluster, [p], [d])
    sock = send_and_hold(r.url, {"text": "a long prompt", "stream": True})
    wait_until(lambda: len(p.requests()) == 1 and len(d.requests()) == 1, 10, what="both sides got the request")
    sock.close()
    wait_until(lambda: d.requests()[0].get("cancelled"), 5, what="decode request cancelled")
    wait_until(lambda: p.requests()[0].get("cancelled"), 5, what="prefill request cancelled")
    room = p.requests()[0]["body"]["bootstrap_room"]
    assert room in p.state()["cancelled"]


def test_regular_client_gone_before_the_answer_cancels_the_worker_request(cluster: Cluster) -> None:
    w = cluster.worker("regular")
    w.control(delay_s=20)
    r = cluster.router("--worker-urls", w.url)
    sock = send_and_hold(r.url, {"text": "slow", "stream": False})
    wait_until(lambda: len(w.requests()) == 1, 10, what="worker got the request")
    sock.close()
    wait_until(lambda: w.requests()[0].get("cancelled"), 5, what="worker request cancelled")
