"""A prefill worker killed (SIGKILL) or frozen (SIGSTOP) mid-transfer: the decode side's room fails within the
heartbeat deadline and never reports Success; the decode worker keeps serving rooms from other prefill workers
(and from the frozen one once it resumes)."""
from __future__ import annotations

import signal
import time

import pytest

from kv_harness import FAST, open_room, run_room

DEADLINE = FAST["heartbeat_timeout"] + 2.0


@pytest.mark.parametrize("backend", ["mooncake", "shm"])
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_prefill_dies_mid_transfer(spawn, backend: str, how: signal.Signals) -> None:
    victim = spawn("prefill", backend, seed=1, name="victim")
    other = spawn("prefill", backend, seed=4, name="other")
    decode = spawn("decode", backend, seed=2)

    open_room(victim, decode, 1, [10, 11, 12, 13])
    victim.call("send", room=1, pages=[0, 1])
    assert decode.wait(1, ["TRANSFERRING"], 5)["state"] == "TRANSFERRING"

    victim.signal(how)
    got = decode.wait(1, ["FAILED", "SUCCESS"], DEADLINE)
    assert got["state"] == "FAILED" and got["kind"] == "peer_dead", got
    time.sleep(0.5)
    assert decode.call("state", room=1)["state"] == "FAILED"  # sticky: never Success afterwards
    decode.call("release", room=1)

    run_room(other, decode, 2, [5, 6], [20, 21])

    if how == signal.SIGSTOP:
        victim.signal(signal.SIGCONT)
        # The resumed prefill heard of the failure (the decode side's heartbeats stopped reaching it or its
        # abort arrived) and serves new rooms through a fresh link.
        assert victim.wait(1, ["FAILED", "SUCCESS"], DEADLINE)["state"] == "FAILED"
        run_room(victim, decode, 3, [7, 8], [30, 31], aux_slot=2)
