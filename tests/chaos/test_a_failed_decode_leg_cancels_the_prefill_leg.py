"""When the decode leg of a PD request fails (the decode worker is gone), the router drops the prefill leg and the
prefill worker ends the request and its room at once, though the prompt is already computed and its pages are
held for the transfer: nothing waits in Bootstrapping for the room's deadline (here 60 s), and no page stays in
use. The same holds for a client that leaves a prefill worker, or ``/abort_request``, while the room is open."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.pd.conftest import bootstrap, start_decode, start_prefill, start_router, wait_pool_idle

BOOTSTRAP_DEADLINE = 60.0


def bootstrapping_rooms(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('splitserve_kv_transfer_rooms{role="prefill",state="bootstrapping"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_failed_decode_leg_cancels_the_prefill_leg(tiny_model_dir: Path) -> None:
    prefill, bport = start_prefill(tiny_model_dir, "--transfer-bootstrap-timeout", str(BOOTSTRAP_DEADLINE))
    decode = start_decode(tiny_model_dir)
    router = None
    try:
        prefill.wait_ready(), decode.wait_ready()
        router = start_router(prefill, bport, decode, "--max-retries", "0").wait_ready(path="/readiness")
        decode.proc.kill()
        decode.proc.wait(30)
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "hello there", "max_tokens": 2}, timeout=60)
        assert r.status_code >= 500, r.text
        wait_pool_idle(prefill, timeout=BOOTSTRAP_DEADLINE / 4)  # well before the room's deadline
        assert bootstrapping_rooms(prefill.url) == 0

        # the worker's own abort reaches a computed request whose room waits for a decode side
        body = {"prompt": "hello again", "max_tokens": 2, "rid": "held-1", **bootstrap(bport, 77)}
        answer: list[httpx.Response] = []
        leg = threading.Thread(target=lambda: answer.append(
            httpx.post(prefill.url + "/v1/completions", json=body, timeout=BOOTSTRAP_DEADLINE * 2)))
        leg.start()  # its answer waits for the room
        deadline = time.monotonic() + 20
        while bootstrapping_rooms(prefill.url) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert bootstrapping_rooms(prefill.url) == 1
        assert httpx.post(prefill.url + "/abort_request", json={"rid": "held-1"}, timeout=10).status_code == 200
        leg.join(BOOTSTRAP_DEADLINE / 4)
        assert answer and answer[0].status_code >= 400, answer
        wait_pool_idle(prefill, timeout=BOOTSTRAP_DEADLINE / 4)
        assert bootstrapping_rooms(prefill.url) == 0
    finally:
        if router is not None:
            router.stop()
        prefill.stop(), decode.stop()
