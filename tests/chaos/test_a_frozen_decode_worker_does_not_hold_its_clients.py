"""A decode worker frozen mid-request (SIGSTOP) does not hold its clients.

- A stream: after --stall-timeout-secs without a byte the router ends it with an error event (never a normal end),
  takes that worker out of rotation at once, and the client's retry, not streamed, is answered by the other decode
  worker. Once thawed and probed healthy, the frozen worker serves again.
- A non-streamed request (which gets no byte before its whole answer): the first health probe that times out takes
  the worker out of rotation at once (not after --health-failure-threshold probes); once its probes have timed out
  for --stall-timeout-secs, the router gives up on it and retries the request on the other decode worker, which
  answers it in full, long before --request-timeout-secs."""
from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.helpers import ServerProcess, wait_until
from tests.pd.conftest import start_decode, start_prefill, wait_pool_idle

STALL_S = 3


@contextlib.contextmanager
def two_decode_cluster(model: Path) -> Iterator[tuple[ServerProcess, list[ServerProcess], ServerProcess]]:
    prefill, bport = start_prefill(model)
    decodes = [start_decode(model), start_decode(model)]
    router = None
    try:
        for s in (prefill, *decodes):
            s.wait_ready()
        router = ServerProcess("router.launch_router", [
            "--pd-disaggregation", "--prefill", prefill.url, str(bport), *(a for d in decodes for a in ("--decode", d.url)),
            "--decode-policy", "round_robin", "--health-check-interval", "1", "--health-check-timeout-secs", "1",
            "--health-failure-threshold", "5", "--request-timeout-secs", "120",
            "--stall-timeout-secs", str(STALL_S)]).wait_ready(path="/readiness")
        yield prefill, decodes, router
    finally:
        for d in decodes:  # thaw any frozen one so that it can stop
            d.proc.send_signal(signal.SIGCONT)
        if router is not None:
            router.stop()
        for s in (prefill, *decodes):
            s.stop()


def healthy(router: ServerProcess) -> dict[str, bool]:
    return {w["url"]: w["healthy"] for w in httpx.get(router.url + "/workers", timeout=5).json()["workers"]}


def test_a_frozen_decode_worker_fails_its_streams_fast(tiny_model_dir: Path) -> None:
    with two_decode_cluster(tiny_model_dir) as (prefill, decodes, router):
        frozen = None
        body = {"prompt": "once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 3:
                    frozen = next(d for d in decodes if httpx.get(d.url + "/get_load", timeout=5).json()["running"])
                    frozen.proc.send_signal(signal.SIGSTOP)
                    break
            started = time.monotonic()
            events += [line[6:] for line in lines if line.startswith("data: ")]
            waited = time.monotonic() - started
        assert events[-1] != "[DONE]", "a stalled stream must not end like a finished one"
        err = json.loads(events[-1])["error"]
        assert err["code"] == "stalled" and "stall-timeout-secs" in err["message"], err
        assert waited < 30, waited  # the stall deadline, not the 1800 s request deadline, ended it
        other = next(d for d in decodes if d is not frozen)
        retry = httpx.post(router.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
        assert retry.status_code == 200, retry.text
        listed = healthy(router)
        assert listed[frozen.url] is False and listed[other.url] is True, listed
        frozen.proc.send_signal(signal.SIGCONT)
        assert wait_until(lambda: healthy(router)[frozen.url], 30), "the thawed worker never came back"
        for d in decodes:
            wait_pool_idle(d)
        wait_pool_idle(prefill)


def test_a_non_streamed_request_on_a_frozen_decode_worker_is_retried_elsewhere(tiny_model_dir: Path) -> None:
    with two_decode_cluster(tiny_model_dir) as (prefill, decodes, router):
        body = {"prompt": "once upon a time", "max_tokens": 1500, "ignore_eos": True}
        answer: dict = {}

        def call() -> None:
            started = time.monotonic()
            r = httpx.post(router.url + "/v1/completions", json=body, timeout=150)
            answer.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - started)

        client = threading.Thread(target=call)
        client.start()
        busy = lambda: [d for d in decodes if httpx.get(d.url + "/get_load", timeout=5).json()["running"]]  # noqa: E731
        assert wait_until(busy, 30), "the request never reached a decode worker"
        frozen = busy()[0]
        other = next(d for d in decodes if d is not frozen)
        frozen.proc.send_signal(signal.SIGSTOP)
        # One timed-out probe (1 s every 1 s) takes it out, though --health-failure-threshold is 5.
        assert wait_until(lambda: not healthy(router)[frozen.url], 4), "a frozen worker stayed in rotation"
        client.join(150)
        assert answer.get("status") == 200, answer
        assert answer["body"]["usage"]["completion_tokens"] == 1500, answer["body"]["usage"]
        assert answer["seconds"] < 100, answer  # released by the stall deadline, not the 120 s request deadline
        assert healthy(router)[other.url] is True
        frozen.proc.send_signal(signal.SIGCONT)
        assert wait_until(lambda: healthy(router)[frozen.url], 30), "the thawed worker never came back"
        for d in decodes:
            wait_pool_idle(d)
        wait_pool_idle(prefill)
