"""SIGTERM: the router stops accepting, lets the in-flight stream finish, then exits 0."""
from __future__ import annotations

import signal

import httpx
import pytest
from harness import Cluster, background_stream, sse_events

from tests.helpers import wait_until


def test_sigterm_lets_the_stream_finish_then_exits(cluster: Cluster) -> None:
    w = cluster.worker()
    w.control(hold_after_first_chunk=True)
    r = cluster.router("--worker-urls", w.url, "--shutdown-grace-period-secs", "20")
    t, got = background_stream(f"{r.url}/generate", {"text": "x", "stream": True})
    wait_until(lambda: len(w.requests()) == 1, what="stream in flight")
    r.popen.send_signal(signal.SIGTERM)
    wait_until(lambda: "shutting down" in r.logs(), what="shutdown logged")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{r.url}/health", timeout=2)
    assert r.popen.poll() is None, "still draining"
    w.release()
    t.join(15)
    assert sse_events(got["body"])[-1] == "[DONE]"
    assert r.popen.wait(15) == 0
    assert "all connections drained" in r.logs()


def test_grace_period_bounds_the_drain(cluster: Cluster) -> None:
    w = cluster.worker()
    w.control(hold_after_first_chunk=True)
    r = cluster.router("--worker-urls", w.url, "--shutdown-grace-period-secs", "0.5")
    t, outcome = background_stream(f"{r.url}/generate", {"text": "x", "stream": True})
    wait_until(lambda: len(w.requests()) == 1, what="stream in flight")
    r.popen.send_signal(signal.SIGTERM)
    assert r.popen.wait(10) == 0
    assert "grace period over" in r.logs()
    t.join(10)
    assert isinstance(outcome.get("error"), httpx.RemoteProtocolError), "the stream was cut at the deadline"
    w.release()
