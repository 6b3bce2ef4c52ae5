"""Streams are forwarded as they come: the client holds the first chunk while the worker is
still blocked before its second one (nothing is buffered to the end)."""
from __future__ import annotations

import httpx
from harness import Cluster, sse_events


def test_first_chunk_arrives_before_the_worker_sends_the_rest(cluster: Cluster) -> None:
    w = cluster.worker()
    w.control(hold_after_first_chunk=True)
    r = cluster.router("--worker-urls", w.url)
    with httpx.stream("POST", f"{r.url}/v1/completions", json={"prompt": "p", "stream": True}, timeout=10) as resp:
        it = resp.iter_raw()
        first = next(it).decode()
        assert "#0" in first
        assert not w.requests()[0]["done"], "the worker has not finished: the chunk was not buffered"
        w.release()
        rest = b"".join(it).decode()
    ev = sse_events(first + rest)
    assert len(ev) == 5 and ev[-1] == "[DONE]"


def test_streams_on_one_keep_alive_connection_are_each_complete(cluster: Cluster) -> None:
    """Framing survives connection reuse: each streamed answer ends where it should."""
    w = cluster.worker()
    w.control(stream_chunks=8)
    r = cluster.router("--worker-urls", w.url)
    with httpx.Client(timeout=10) as c:
        for i in range(20):
            ev = sse_events(c.post(f"{r.url}/generate", json={"text": f"t{i}", "stream": True}).text)
            assert len(ev) == 9 and ev[-1] == "[DONE]" and all(f"#{k} " in ev[k] for k in range(8))
    assert len(w.requests()) == 20
