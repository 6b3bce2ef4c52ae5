"""Every state has a deadline: rooms that stop moving fail on both sides instead of hanging."""
from __future__ import annotations

import time

from kv_inproc import InProcPair

from kv_transfer import RoomState
from tests.helpers import wait_until

SHORT = dict(bootstrap_timeout=0.5, waiting_timeout=0.5, transfer_timeout=0.5)


def _failed_by_timeout(room: object) -> bool:
    return room.poll() == RoomState.FAILED and room.failure.kind.value == "timeout"  # type: ignore[attr-defined]


def test_prefill_request_never_arrives() -> None:
    """Decode sent its room info but the prefill worker never creates the sender: both sides time out."""
    pair = InProcPair("fake", **SHORT)
    try:
        receiver = pair.decode.create_receiver(1, "127.0.0.1", pair.port)
        receiver.init([1, 2], aux_slot=0)
        assert wait_until(lambda: receiver.poll().terminal, 5)
        assert receiver.poll() == RoomState.FAILED
        assert receiver.failure.kind.value in ("timeout", "aborted_remote"), receiver.failure_reason
        # The prefill worker's late request sees the failure instead of waiting forever.
        sender = pair.prefill.create_sender(1)
        assert wait_until(lambda: sender.poll() == RoomState.FAILED, 5)
    finally:
        pair.close()


def test_decode_never_sends_room_info() -> None:
    pair = InProcPair("fake", **SHORT)
    try:
        sender = pair.prefill.create_sender(2)
        assert sender.poll() == RoomState.BOOTSTRAPPING
        assert wait_until(lambda: _failed_by_timeout(sender), 5), sender.failure_reason
        assert "BOOTSTRAPPING" in sender.failure_reason
    finally:
        pair.close()


def test_prefill_never_starts_or_stalls_mid_transfer() -> None:
    pair = InProcPair("fake", **SHORT)
    try:
        waiting = pair.decode.create_receiver(3, "127.0.0.1", pair.port)
        waiting.init([1], aux_slot=0)
        s3 = pair.prefill.create_sender(3)
        stalled = pair.decode.create_receiver(4, "127.0.0.1", pair.port)
        stalled.init([2, 3], aux_slot=1)
        s4 = pair.prefill.create_sender(4)
        assert wait_until(lambda: s4.poll() == RoomState.WAITING_FOR_INPUT, 5)
        s4.send([5])  # one chunk, then the prefill side goes quiet
        assert wait_until(lambda: stalled.poll() == RoomState.TRANSFERRING, 5)
        assert wait_until(lambda: _failed_by_timeout(waiting) or waiting.poll() == RoomState.FAILED, 5)
        assert wait_until(lambda: stalled.poll() == RoomState.FAILED, 5)
        assert "TRANSFERRING" in (stalled.failure_reason or "") or "TRANSFERRING" in (s4.failure_reason or "")
        assert wait_until(lambda: s3.poll() == RoomState.FAILED and s4.poll() == RoomState.FAILED, 5)
    finally:
        pair.close()


def test_progress_rearms_the_transfer_deadline() -> None:
    pair = InProcPair("fake", **SHORT)
    try:
        receiver = pair.decode.create_receiver(5, "127.0.0.1", pair.port)
        receiver.init(list(range(8)), aux_slot=0)
        sender = pair.prefill.create_sender(5)
        assert wait_until(lambda: sender.poll() == RoomState.WAITING_FOR_INPUT, 5)
        for i in range(8):  # 8 chunks 0.2 s apart: 1.6 s in Transferring, never 0.5 s without progress
            sender.send([10 + i], last=i == 7, first_token_id=1)
            time.sleep(0.2)
        assert wait_until(lambda: receiver.poll().terminal, 5)
        assert receiver.poll() == RoomState.SUCCESS, receiver.failure_reason
    finally:
        pair.close()
