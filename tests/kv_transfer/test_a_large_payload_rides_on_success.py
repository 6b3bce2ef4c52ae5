"""A payload too large for an aux record (a prompt's logprobs) reaches the decode side whole with Success, beyond
gRPC's default 4 MB message limit; one over MAX_EXTRA_PAYLOAD is refused before anything is written."""
from __future__ import annotations

import os

import pytest
from kv_inproc import InProcPair

from kv_transfer import PageIndexError, RoomState
from kv_transfer.wire.aux import MAX_EXTRA_PAYLOAD
from tests.helpers import wait_until


def _ready(pair: InProcPair, room: int, pages: list[int], slot: int):  # type: ignore[no-untyped-def]
    receiver = pair.decode.create_receiver(room, "127.0.0.1", pair.port)
    receiver.init(pages, aux_slot=slot)
    sender = pair.prefill.create_sender(room)
    assert wait_until(lambda: sender.poll() == RoomState.WAITING_FOR_INPUT, 5), sender.failure_reason
    return receiver, sender


def test_a_large_payload_rides_on_success() -> None:
    pair = InProcPair("fake")
    try:
        receiver, sender = _ready(pair, 1, [7, 8], 0)
        payload = os.urandom(5 << 20)
        sender.send([1, 2], last=True, first_token_id=5, extra_payload=payload)
        assert wait_until(lambda: receiver.poll() == RoomState.SUCCESS, 10), receiver.failure_reason
        assert receiver.extra_payload == payload and receiver.aux_record.first_token_id == 5
        assert pair.dst.checksums([7, 8]) == pair.src.checksums([1, 2])

        plain, sender = _ready(pair, 2, [9], 1)  # without one, Success carries nothing
        sender.send([3], last=True, first_token_id=6)
        assert wait_until(lambda: plain.poll() == RoomState.SUCCESS, 5) and plain.extra_payload == b""

        too_big, sender = _ready(pair, 3, [10], 2)
        with pytest.raises(PageIndexError, match="extra payload"):
            sender.send([4], last=True, first_token_id=7, extra_payload=b"\0" * (MAX_EXTRA_PAYLOAD + 1))
        assert sender.pages_queued == 0 and too_big.poll() == RoomState.WAITING_FOR_INPUT
        sender.abort("test over")
    finally:
        pair.close()
