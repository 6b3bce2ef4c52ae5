"""A decode worker frozen mid-stream (SIGSTOP) does not hold its client: after --stall-timeout-secs without a byte
the router ends the stream with an error event (never a normal end), takes that worker out of rotation at once,
and the client's retry, not streamed, is answered by the other decode worker. Once thawed and probed healthy,
the frozen worker serves again."""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx

from tests.helpers import ServerProcess
from tests.pd.conftest import start_decode, start_prefill, wait_pool_idle

STALL_S = 3


def test_a_frozen_decode_worker_fails_its_streams_fast(tiny_model_dir: Path) -> None:
    prefill, bport = start_prefill(tiny_model_dir)
    decodes = [start_decode(tiny_model_dir), start_decode(tiny_model_dir)]
    router = None
    frozen = None
    try:
        for s in (prefill, *decodes):
            s.wait_ready()
        router = ServerProcess("router.launch_router", [
            "--pd-disaggregation", "--prefill", prefill.url, str(bport), *(a for d in decodes for a in ("--decode", d.url)),
            "--decode-policy", "round_robin", "--health-check-interval", "1", "--health-check-timeout-secs", "1",
            "--stall-timeout-secs", str(STALL_S)]).wait_ready(path="/readiness")
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
        listed = {w["url"]: w["healthy"] for w in httpx.get(router.url + "/workers", timeout=5).json()["workers"]}
        assert listed[frozen.url] is False and listed[other.url] is True, listed
        frozen.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not next(
                w["healthy"] for w in httpx.get(router.url + "/workers", timeout=5).json()["workers"]
                if w["url"] == frozen.url):
            time.sleep(0.2)
        frozen = None
        for d in decodes:
            wait_pool_idle(d)
        wait_pool_idle(prefill)
    finally:
        if frozen is not None:
            frozen.proc.send_signal(signal.SIGCONT)
        if router is not None:
            router.stop()
        for s in (prefill, *decodes):
            s.stop()
