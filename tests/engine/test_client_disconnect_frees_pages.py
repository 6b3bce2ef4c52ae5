"""A client that goes away mid-stream (or mid-wait) aborts its request: it stops running and every page it
held goes back, so after a cache flush the pool is at its idle size; constrained streams too."""
from __future__ import annotations

import time

import httpx

from tests.helpers import ServerProcess


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = httpx.get(server.url + "/get_load").json()
        if load["running"] == 0 and load["queued"] == 0:
            return load
        time.sleep(0.1)
    raise AssertionError(f"still busy after {timeout}s: {load}")


def pool_after_flush(server: ServerProcess) -> int:
    httpx.post(server.url + "/flush_cache")
    return httpx.get(server.url + "/get_load").json()["kv_pages_used"]


def test_disconnect_mid_stream_aborts_and_frees_pages(server: ServerProcess) -> None:
    wait_idle(server)
    body = {"prompt": "Tell a very long story", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 5:
                break
    assert httpx.get(server.url + "/get_load").json()["running"] <= 1
    wait_idle(server)
    assert pool_after_flush(server) == 0


def test_constrained_streams_cut_mid_structure_free_their_pages(server: ServerProcess) -> None:
    """Constrained requests (jump-forward appending tokens ahead of the model) aborted mid-document, while
    unconstrained ones run beside them, leave nothing behind."""
    wait_idle(server)
    schema = {"type": "object", "properties": {f"a_rather_long_field_name_{i}": {"type": "string", "maxLength": 200}
                                               for i in range(6)}, "required": [f"a_rather_long_field_name_{i}"
                                                                                for i in range(6)]}
    bodies = [{"prompt": f"Record {i}:", "max_tokens": 2000, "stream": True, "temperature": 1.0, "seed": i,
               **({"json_schema": schema} if i % 2 == 0 else {"ignore_eos": True})} for i in range(6)]
    streams = [httpx.stream("POST", server.url + "/v1/completions", json=b, timeout=60) for b in bodies]
    for cm in streams:
        r = cm.__enter__()
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 4:
                break
        cm.__exit__(None, None, None)
    wait_idle(server)
    assert pool_after_flush(server) == 0
    done = httpx.post(server.url + "/v1/completions", json={**bodies[0], "stream": False, "max_tokens": 2000},
                      timeout=120).json()  # and the same schema still answers in full afterwards
    assert done["choices"][0]["finish_reason"] in ("stop", "length")


def test_non_streaming_client_timeout_aborts_the_request(server: ServerProcess) -> None:
    wait_idle(server)
    body = {"prompt": "Another long one", "max_tokens": 3000, "ignore_eos": True}
    try:
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("the request was expected to outlast the client's timeout")
    wait_idle(server)
    assert pool_after_flush(server) == 0
