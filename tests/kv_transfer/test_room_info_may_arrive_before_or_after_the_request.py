"""The decode side's room info may reach the prefill worker before or after its own request: both work."""
from __future__ import annotations

from kv_inproc import InProcPair

from kv_transfer import RoomState
from tests.helpers import wait_until


def _finish(pair: InProcPair, room: int, receiver, sender) -> None:  # type: ignore[no-untyped-def]
    assert wait_until(lambda: sender.poll() == RoomState.WAITING_FOR_INPUT, 5), sender.failure_reason
    assert sender.dst_pages == (7, 8, 9) and sender.held_prefix_tokens == 16
    sender.send([1, 2, 3], last=True, first_token_id=99, cached_tokens=16)
    assert wait_until(lambda: receiver.poll() == RoomState.SUCCESS, 5), receiver.failure_reason
    assert wait_until(lambda: sender.poll() == RoomState.SUCCESS, 5)
    assert receiver.aux_record.first_token_id == 99 and receiver.aux_record.cached_tokens == 16
    assert pair.dst.checksums([7, 8, 9]) == pair.src.checksums([1, 2, 3])


def test_decode_info_first() -> None:
    pair = InProcPair("fake")
    try:
        receiver = pair.decode.create_receiver(1, "127.0.0.1", pair.port)
        receiver.init([7, 8, 9], aux_slot=0, held_prefix_tokens=16)
        assert wait_until(lambda: receiver.poll() == RoomState.WAITING_FOR_INPUT, 5)
        _finish(pair, 1, receiver, pair.prefill.create_sender(1))
    finally:
        pair.close()


def test_prefill_request_first() -> None:
    pair = InProcPair("fake")
    try:
        sender = pair.prefill.create_sender(2)
        assert sender.poll() == RoomState.BOOTSTRAPPING and sender.dst_pages is None
        receiver = pair.decode.create_receiver(2, "127.0.0.1", pair.port)
        assert receiver.poll() == RoomState.BOOTSTRAPPING
        receiver.init([7, 8, 9], aux_slot=3, held_prefix_tokens=16)
        _finish(pair, 2, receiver, sender)
    finally:
        pair.close()
