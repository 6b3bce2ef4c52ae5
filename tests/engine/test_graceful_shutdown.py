"""SIGTERM lets in-flight requests finish and the server exits 0; past the grace period they are aborted."""
from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx

from tests.helpers import ServerProcess


def sigterm_during(srv: ServerProcess, prompt: str, max_tokens: int) -> httpx.Response:
    """Send a completion, SIGTERM the server once it is running, and return the completion's response once
    the server has exited (with status 0)."""
    result: dict[str, httpx.Response | BaseException] = {}

    def call() -> None:
        try:
            result["response"] = httpx.post(srv.url + "/v1/completions", timeout=60,
                                            json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
        except httpx.HTTPError as e:
            result["response"] = e

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 20
    while httpx.get(srv.url + "/get_load").json()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert srv.wait_exit(60) == 0
    response = result["response"]
    assert isinstance(response, httpx.Response), f"the request got no HTTP response: {response!r}"
    return response


def test_sigterm_finishes_in_flight_requests_and_exits_zero(tiny_model_dir: Path) -> None:
    srv = ServerProcess("engine", ["--model-path", str(tiny_model_dir), "--max-total-tokens", "4096"]).wait_ready()
    r = sigterm_during(srv, "finish me", 300)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 300


def test_requests_still_running_after_the_grace_period_get_an_error_not_a_partial_answer(
        tiny_model_dir: Path) -> None:
    srv = ServerProcess("engine", ["--model-path", str(tiny_model_dir), "--max-total-tokens", "8192",
                                   "--shutdown-timeout", "1"]).wait_ready()
    r = sigterm_during(srv, "never finishes in time", 4000)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
