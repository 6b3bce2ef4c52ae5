"""The decode side reports Success only when the prefill side wrote every reserved page and the aux slot
carries this room's id; a Success event without them fails the room (never a partial Success)."""
from __future__ import annotations

import ctypes

from kv_inproc import InProcPair

from kv_transfer import AuxRecord, RoomState
from kv_transfer.decode.receiver import Remote
from tests.helpers import wait_until


def _opened(pair: InProcPair, room: int, pages: list[int], slot: int):  # type: ignore[no-untyped-def]
    receiver = pair.decode.create_receiver(room, "127.0.0.1", pair.port)
    receiver.init(pages, aux_slot=slot)
    assert wait_until(lambda: receiver.poll() == RoomState.WAITING_FOR_INPUT, 5)
    return receiver


def test_success_needs_every_page_and_the_aux_record() -> None:
    pair = InProcPair("fake")
    try:
        partial = _opened(pair, 1, [1, 2, 3], 0)
        partial.feed(Remote(RoomState.SUCCESS, pages_done=2))
        assert partial.poll() == RoomState.FAILED and partial.failure.kind.value == "aux_mismatch"
        assert "2 pages written, 3 were reserved" in partial.failure_reason

        no_aux = _opened(pair, 2, [4], 1)  # aux slot still cleared: nothing was written
        no_aux.feed(Remote(RoomState.SUCCESS, pages_done=1))
        assert no_aux.poll() == RoomState.FAILED and "expected 2" in no_aux.failure_reason

        stale = _opened(pair, 3, [5], 2)
        pair.aux.layout.clear(2)
        record = AuxRecord(7, 0, 99).pack()  # another room's record
        ctypes.memmove(pair.aux.layout.slot_address(2), record, len(record))
        stale.feed(Remote(RoomState.SUCCESS, pages_done=1))
        assert stale.poll() == RoomState.FAILED and "holds room 99" in stale.failure_reason

        # A late Success after a failure changes nothing: failures are final.
        partial.feed(Remote(RoomState.SUCCESS, pages_done=3))
        assert partial.poll() == RoomState.FAILED
        # The decode side told the prefill side, which stopped the room too.
        assert wait_until(lambda: pair.prefill.rooms_by_state()[RoomState.FAILED] == 3, 5)
    finally:
        pair.close()
