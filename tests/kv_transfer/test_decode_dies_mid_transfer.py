"""A decode worker killed (SIGKILL) or frozen (SIGSTOP) mid-transfer: the prefill side's room fails within
the heartbeat deadline, its pages can be released, and other rooms on the same prefill worker keep working."""
from __future__ import annotations

import signal

import pytest

from kv_harness import FAST, open_room, run_room

DEADLINE = FAST["heartbeat_timeout"] + 2.0  # detection deadline plus scheduling slack on 2 busy cores


@pytest.mark.parametrize("backend", ["mooncake", "shm"])
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_decode_dies_mid_transfer(spawn, backend: str, how: signal.Signals) -> None:
    prefill = spawn("prefill", backend, seed=1)
    victim = spawn("decode", backend, seed=2, name="victim")
    bystander = spawn("decode", backend, seed=3, name="bystander")

    open_room(prefill, victim, 1, [10, 11, 12, 13])
    open_room(prefill, bystander, 2, [20, 21])
    prefill.call("send", room=1, pages=[0, 1])  # first chunk lands
    assert victim.wait(1, ["TRANSFERRING"], 5)["state"] == "TRANSFERRING"

    victim.signal(how)
    queued = prefill.call("send", room=1, pages=[2])  # a write to the dead/frozen peer, off our thread
    got = prefill.wait(1, ["FAILED", "SUCCESS"], DEADLINE)
    assert got["state"] == "FAILED", got
    assert got["kind"] in ("peer_dead", "transfer_io"), got
    assert queued["state"] in ("TRANSFERRING", "FAILED")
    assert prefill.call("send", room=1, pages=[3], last=True, first_token=1)["queued"] is False
    prefill.call("release", room=1)

    # The same prefill worker keeps serving the other decode worker, while the victim is still frozen.
    prefill.call("send", room=2, pages=[30, 31], last=True, first_token=2)
    assert bystander.wait(2, ["SUCCESS", "FAILED"], 10)["state"] == "SUCCESS"
    run_room(prefill, bystander, 3, [40, 41, 42], [5, 6, 7], aux_slot=1)
    counts = prefill.call("metrics")
    assert counts["failures"].get(got["kind"], 0) >= 1
