"""A room id already in flight is refused on both sides; the first room is unaffected."""
from __future__ import annotations

import pytest

from kv_harness import PeerError


def test_duplicate_room_is_refused(spawn) -> None:
    prefill = spawn("prefill", "shm", seed=1)
    decode_a = spawn("decode", "shm", seed=2, name="decode-a")
    decode_b = spawn("decode", "shm", seed=3, name="decode-b")
    room = 2**62 + 12345

    decode_a.call("recv", room=room, port=prefill.port, pages=[1, 2, 3], aux_slot=0)
    assert decode_a.wait(room, ["WAITING_FOR_INPUT"], 5)["state"] == "WAITING_FOR_INPUT"

    # Same decode worker, same room in flight: refused locally.
    with pytest.raises(PeerError) as info:
        decode_a.call("recv", room=room, port=prefill.port, pages=[4], aux_slot=1)
    assert info.value.type == "DuplicateRoomError"

    # Another decode worker claiming the same room: the prefill side refuses it.
    decode_b.call("recv", room=room, port=prefill.port, pages=[4, 5, 6], aux_slot=0)
    got = decode_b.wait(room, ["FAILED", "SUCCESS"], 5)
    assert got["state"] == "FAILED" and got["error"] == "DuplicateRoomError", got

    # Prefill worker creating the sender twice: refused.
    prefill.call("sender", room=room)
    with pytest.raises(PeerError) as info:
        prefill.call("sender", room=room)
    assert info.value.type == "DuplicateRoomError"

    # The first room still completes, into decode-a's pages.
    assert prefill.call("dst", room=room)["dst"] == [1, 2, 3]
    prefill.call("send", room=room, pages=[7, 8, 9], last=True, first_token=1)
    assert decode_a.wait(room, ["SUCCESS", "FAILED"], 5)["state"] == "SUCCESS"
    assert decode_a.call("checksums", pages=[1, 2, 3])["sums"] == prefill.call("checksums", pages=[7, 8, 9])["sums"]

    # Out-of-range room ids are refused too.
    with pytest.raises(PeerError) as info:
        decode_a.call("recv", room=2**63, port=prefill.port, pages=[1], aux_slot=0)
    assert info.value.type == "InvalidRoomError"
