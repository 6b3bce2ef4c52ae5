"""The rooms-by-state gauge counts each room exactly once, in the state it is in, whatever order state changes,
their notices and removals come in (a room's state changes under its own lock; the table hears of it after, so a
removal or a later change can come in between). Seeded random interleavings; every gauge ends at zero."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from kv_transfer import RoomState, TransferMetrics
from kv_transfer.rooms import RoomTable

FORWARD = [RoomState.BOOTSTRAPPING, RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING, RoomState.SUCCESS]


@dataclass
class FakeRoom:
    room: int
    state: RoomState = RoomState.BOOTSTRAPPING
    failure: None = None


def gauge(metrics: TransferMetrics) -> Counter:
    return Counter({RoomState[name]: n for name, n in metrics.snapshot()["rooms"].items()})


@pytest.mark.parametrize("seed", range(40))
def test_room_gauges_follow_the_rooms_in_any_order(seed: int) -> None:
    rng = random.Random(seed)
    metrics = TransferMetrics("decode")
    table: RoomTable = RoomTable(metrics)
    rooms: dict[int, FakeRoom] = {}
    pending: list[tuple[FakeRoom, RoomState, RoomState]] = []  # notices not yet delivered
    next_id = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.2 or not rooms:
            handle = FakeRoom(next_id)
            next_id += 1
            with table.lock:
                table.put(handle)  # type: ignore[arg-type]
            rooms[handle.room] = handle
        elif op < 0.55:
            handle = rng.choice(list(rooms.values()))
            if handle.state in (RoomState.SUCCESS, RoomState.FAILED):
                continue
            old = handle.state
            handle.state = RoomState.FAILED if rng.random() < 0.3 else FORWARD[FORWARD.index(old) + 1]
            pending.append((handle, old, handle.state))
        elif op < 0.8 and pending:
            handle, old, new = pending.pop(rng.randrange(len(pending)))  # out of order, too
            table.changed(handle, old, new)  # type: ignore[arg-type]
        else:
            handle = rooms.pop(rng.choice(list(rooms)))
            table.remove(handle)  # type: ignore[arg-type]  # maybe before its notices arrive
        assert all(n >= 0 for n in gauge(metrics).values()), gauge(metrics)
    for handle, old, new in pending:
        table.changed(handle, old, new)  # type: ignore[arg-type]
    assert gauge(metrics) == Counter(r.state for r in rooms.values())
    for handle in list(rooms.values()):
        table.remove(handle)  # type: ignore[arg-type]
    assert gauge(metrics) == Counter()
