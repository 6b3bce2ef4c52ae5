"""Either side's abort reaches the other side, which fails the room; both keep serving other rooms."""
from __future__ import annotations

from kv_harness import open_room, run_room


def test_decode_abort_stops_the_prefill_side(spawn) -> None:
    prefill = spawn("prefill", "mooncake", seed=1)
    decode = spawn("decode", "mooncake", seed=2)
    open_room(prefill, decode, 1, [1, 2, 3])
    prefill.call("send", room=1, pages=[4])
    decode.call("abort", room=1, reason="client went away")
    got = prefill.wait(1, ["FAILED", "SUCCESS"], 5)
    assert got["state"] == "FAILED" and got["kind"] == "aborted_remote", got
    assert "client went away" in got["reason"]
    assert prefill.call("send", room=1, pages=[5, 6], last=True, first_token=1)["queued"] is False
    assert decode.call("state", room=1)["kind"] == "aborted_local"
    run_room(prefill, decode, 2, [7, 8], [9, 10])


def test_prefill_abort_fails_the_decode_side(spawn) -> None:
    prefill = spawn("prefill", "shm", seed=1)
    decode = spawn("decode", "shm", seed=2)
    open_room(prefill, decode, 1, [1, 2, 3])
    prefill.call("abort", room=1, reason="out of memory")
    got = decode.wait(1, ["FAILED", "SUCCESS"], 5)
    assert got["state"] == "FAILED" and got["kind"] == "aborted_remote", got
    assert "out of memory" in got["reason"]
    run_room(prefill, decode, 2, [7, 8], [9, 10])
