"""A worker killed (SIGKILL) or frozen (SIGSTOP) in the middle of a request: the surviving side fails the
request with an error within its deadline (never a 200 with a partial answer), returns its pool to the idle
size, and serves new requests."""
from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest

from tests.helpers import wait_until
from tests.pd.conftest import start_decode, start_prefill, wait_pool_idle
from tests.pd.faults import LONG_PROMPT, pair, rooms, serves

ERROR_WITHIN = 30  # seconds: prefill time before the fault + the 2 s heartbeat deadline + slack for a loaded machine
SLOW_PREFILL = ("--chunked-prefill-size", "8")
# The decode side's death must be noticed while pages are still moving: a frozen decode worker's shared
# memory still takes writes, so the prefill must outlast the 2 s heartbeat deadline by a wide margin even on
# a fast machine (4000 tokens in 4-token chunks took ~5 s once, then 1.8 s on a Zen 5 host, under the deadline:
# one-token chunks, 4000 steps).
SLOWER_PREFILL = ("--chunked-prefill-size", "1")
LONGER_PROMPT = [random.Random(2).randrange(10, 4000) for _ in range(4000)]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_decode_dies_mid_transfer(tiny_model_dir: Path, sig: signal.Signals) -> None:
    prefill, bport = start_prefill(tiny_model_dir, *SLOWER_PREFILL)
    decode = start_decode(tiny_model_dir)
    spare = start_decode(tiny_model_dir)
    try:
        for srv in (prefill, decode, spare):
            srv.wait_ready()
        p, d = pair(prefill, bport, decode, 101, LONGER_PROMPT)
        wait_until(lambda: rooms(prefill, "prefill", "transferring") >= 1, what="pages moving")
        decode.proc.send_signal(sig)
        p.wait()
        assert p.status == 502 and "KV transfer failed" in p.body_out["error"]["message"], p.body_out
        assert p.elapsed is not None and p.elapsed < ERROR_WITHIN
        wait_pool_idle(prefill)
        serves(prefill, bport, spare, 102)
        if sig == signal.SIGSTOP:  # thawed, the decode worker fails its room too and recovers
            decode.proc.send_signal(signal.SIGCONT)
            d.wait()
            assert d.status != 200, d.body_out
            wait_pool_idle(decode)
            serves(prefill, bport, decode, 103)
    finally:
        for srv in (prefill, decode, spare):
            if srv.proc.poll() is None:
                srv.proc.send_signal(signal.SIGCONT)
            srv.stop()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_prefill_dies_mid_prefill(tiny_model_dir: Path, sig: signal.Signals) -> None:
    prefill, bport = start_prefill(tiny_model_dir, *SLOW_PREFILL)
    spare, spare_port = start_prefill(tiny_model_dir)
    decode = start_decode(tiny_model_dir)
    try:
        for srv in (prefill, spare, decode):
            srv.wait_ready()
        p, d = pair(prefill, bport, decode, 201, LONG_PROMPT)
        wait_until(lambda: rooms(decode, "decode", "transferring") + rooms(decode, "decode", "waiting_for_input") >= 1,
                 what="room open on the decode side")
        prefill.proc.send_signal(sig)
        d.wait()
        assert d.status == 502 and "KV transfer failed" in d.body_out["error"]["message"], d.body_out
        assert d.elapsed is not None and d.elapsed < ERROR_WITHIN
        wait_pool_idle(decode)
        serves(spare, spare_port, decode, 202)
        if sig == signal.SIGSTOP:
            prefill.proc.send_signal(signal.SIGCONT)
            p.wait()
            assert p.status != 200, p.body_out
            wait_pool_idle(prefill)
            serves(prefill, bport, decode, 203)
    finally:
        for srv in (prefill, spare, decode):
            if srv.proc.poll() is None:
                srv.proc.send_signal(signal.SIGCONT)
            srv.stop()
