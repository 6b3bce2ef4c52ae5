"""Through the router: a client that goes away while its long prompt is still being prefilled (before the
first token, so before the router has written it a byte) makes the router drop both upstream requests. The
decode worker aborts its room, the prefill worker stops (its room fails as aborted), and both pools return
to idle; the cluster keeps serving."""
from __future__ import annotations

import json
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import ServerProcess, wait_until
from tests.pd.conftest import start_decode, start_prefill, start_router, wait_pool_idle
from tests.pd.faults import failures, rooms

LONG_PROMPT = [random.Random(5).randrange(10, 4000) for _ in range(3000)]


@dataclass
class PdCluster:
    prefill: ServerProcess
    decode: ServerProcess
    router: ServerProcess


@pytest.fixture(scope="module")
def pd_cluster(tiny_model_dir: Path) -> Iterator[PdCluster]:
    # Prefill in 8-token chunks, so a 3000-token prompt keeps its room open for a while.
    prefill, bport = start_prefill(tiny_model_dir, "--chunked-prefill-size", "8")
    decode = start_decode(tiny_model_dir)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router = start_router(prefill, bport, decode).wait_ready(path="/readiness")
        yield PdCluster(prefill, decode, router)
        router.stop()
    finally:
        prefill.stop()
        decode.stop()


def aborted(server: ServerProcess) -> float:
    return failures(server, "prefill", "aborted_remote") + failures(server, "prefill", "aborted_local")


def room_open(server: ServerProcess) -> bool:
    return rooms(server, "prefill", "transferring") + rooms(server, "prefill", "waiting_for_input") >= 1


def test_client_gone_during_prefill_aborts_both_workers(pd_cluster: PdCluster) -> None:
    c = pd_cluster
    before = aborted(c.prefill)
    body = json.dumps({"input_ids": LONG_PROMPT, "sampling_params": {"max_new_tokens": 4}, "stream": True})
    host, port = c.router.url.removeprefix("http://").split(":")
    # A raw socket: an HTTP client would block until the response head, which comes with the first token.
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall((f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        wait_until(lambda: room_open(c.prefill), timeout=30, what="the prefill room open")
    # The socket is closed; the prefill is far from done. The room must fail as aborted, not succeed.
    wait_until(lambda: aborted(c.prefill) > before, timeout=30, what="the prefill room aborted")
    assert not room_open(c.prefill)
    for srv in (c.prefill, c.decode):
        wait_pool_idle(srv)
    r = httpx.post(c.router.url + "/generate", json={"input_ids": list(range(10, 60)),
                                                     "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
