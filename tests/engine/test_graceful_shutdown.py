"""SIGTERM lets in-flight requests finish and the server exits 0; past the grace period they are aborted."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx

from tests.helpers import ServerProcess


def test_sigterm_finishes_in_flight_requests_and_exits_zero(tiny_model_dir: Path) -> None:
    srv = ServerProcess("engine", ["--model-path", str(tiny_model_dir), "--max-total-tokens", "4096"]).wait_ready()
    result: dict = {}

    def call() -> None:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"prompt": "finish me", "max_tokens": 300, "ignore_eos": True})
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 20
    while httpx.get(srv.url + "/get_load").json()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert srv.wait_exit(60) == 0
    assert result["status"] == 200 and result["body"]["usage"]["completion_tokens"] == 300


def test_requests_still_running_after_the_grace_period_get_an_error_not_a_partial_answer(
        tiny_model_dir: Path) -> None:
    srv = ServerProcess("engine", ["--model-path", str(tiny_model_dir), "--max-total-tokens", "8192",
                                   "--shutdown-timeout", "1"]).wait_ready()
    result: dict = {}

    def call() -> None:
        try:
            r = httpx.post(srv.url + "/v1/completions", timeout=60,
                           json={"prompt": "never finishes in time", "max_tokens": 4000, "ignore_eos": True})
            result["status"], result["body"] = r.status_code, r.json()
        except httpx.HTTPError as e:  # the connection may be closed instead
            result["error"] = type(e).__name__

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 20
    while httpx.get(srv.url + "/get_load").json()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert srv.wait_exit(60) == 0
    assert result["status"] == 503 and "shutting down" in result["body"]["error"]["message"], result
