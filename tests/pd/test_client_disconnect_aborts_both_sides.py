"""A client that goes away aborts its request on both workers: mid-stream through the router (decode stops
decoding), and before the first token (the decode worker aborts the room, the prefill worker hears it and stops
its prefill); both pools return to their idle size and both keep serving."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx

from tests.helpers import wait_until
from tests.pd.conftest import Cluster, bootstrap, start_prefill, wait_pool_idle
from tests.pd.faults import LONG_PROMPT, Call, failures, rooms, serves


def test_disconnect_mid_stream_stops_decoding(cluster: Cluster) -> None:
    body = {"prompt": "Write forever", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster.router.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 5:
                break
    for srv in (cluster.prefill, cluster.decode):
        wait_pool_idle(srv)
    serves(cluster.prefill, cluster.bport, cluster.decode, 301)


def test_disconnect_before_the_first_token_aborts_the_prefill(cluster: Cluster, tiny_model_dir: Path) -> None:
    """Playing the router: the prefill call stays, the decode connection is dropped while the room is open. The
    prefill runs on its own worker in 4-token chunks (750 steps), so it is still running when the abort arrives:
    the cluster's 32-token chunks finished the prompt first on a fast host."""
    prefill, bport = start_prefill(tiny_model_dir, "--chunked-prefill-size", "4")
    try:
        prefill.wait_ready()
        before = failures(prefill, "prefill", "aborted_remote")
        body = {"input_ids": LONG_PROMPT, "sampling_params": {"max_new_tokens": 4}, "stream": True,
                **bootstrap(bport, 303)}
        p = Call(prefill.url, body).start()
        raw = json.dumps(body)
        host, port = cluster.decode.url.removeprefix("http://").split(":")
        # A raw socket: an HTTP client would block until the response headers, which come with the first token.
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall((f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(raw)}\r\n\r\n{raw}").encode())
            wait_until(lambda: rooms(cluster.decode, "decode", "transferring")
                       + rooms(cluster.decode, "decode", "waiting_for_input") >= 1, what="room open")
        p.wait()
        assert p.status == 502 and "aborted by decode" in p.body_out["error"]["message"], p.body_out
        assert failures(prefill, "prefill", "aborted_remote") > before
        for srv in (prefill, cluster.decode):
            wait_pool_idle(srv)
        serves(prefill, bport, cluster.decode, 304)
    finally:
        prefill.stop()
