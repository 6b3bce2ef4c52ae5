"""What both sides' rooms share: the handle a worker polls (RoomHandle) and the manager's table (RoomTable)."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, Generic, TypeVar

from kv_transfer.config import TransferConfig
from kv_transfer.metrics import TransferMetrics
from kv_transfer.state import Failure, FailureKind, RoomState, RoomTracker


class RoomHandle(ABC):
    """One room on one side: non-blocking state, failure and release. Subclasses add abort() and the rest."""

    def __init__(self, room: int, config: TransferConfig,
                 on_change: Callable[[Any, RoomState, RoomState], None],
                 on_release: Callable[[Any], None]) -> None:
        self.room = room
        self._tracker = RoomTracker(room, config, lambda _t, old, new: on_change(self, old, new))
        self._on_release = on_release

    def poll(self) -> RoomState:
        """Current state, without blocking."""
        return self._tracker.state

    @property
    def state(self) -> RoomState:
        return self._tracker.state

    @property
    def failure(self) -> Failure | None:
        return self._tracker.failure

    @property
    def failure_reason(self) -> str | None:
        f = self._tracker.failure
        return str(f) if f else None

    @property
    def tracker(self) -> RoomTracker:
        return self._tracker

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Fail the room with `reason` and tell the other side."""

    def release(self) -> None:
        """Forget the room (aborting it first if still in flight)."""
        if not self._tracker.state.terminal:
            self.abort("released before finishing")
        self._on_release(self)


R = TypeVar("R", bound=RoomHandle)


class RoomTable(Generic[R]):
    """The manager's rooms by id, kept in step with the rooms-by-state metric.

    `lock` is public so a manager can make check-then-insert sequences atomic (use `put` under it).

    The gauge counts, per tabled room, the state it was last counted in (not the state a change notice names):
    a room's state changes under its own lock and the notice reaches the table after, so a removal may come
    between the two, and notices of two quick changes may arrive out of order. Counting "what this room was
    counted as" -> "what it is now" makes every order end with the gauge equal to the rooms' states, and at
    zero once they are removed.
    """

    def __init__(self, metrics: TransferMetrics) -> None:
        self.lock = threading.Lock()
        self._rooms: dict[int, R] = {}
        self._counted: dict[int, RoomState] = {}
        self._metrics = metrics

    def get(self, room: int) -> R | None:
        with self.lock:
            return self._rooms.get(room)

    def peek(self, room: int) -> R | None:
        """Like get(), for a caller that holds `lock`."""
        return self._rooms.get(room)

    def put(self, handle: R) -> None:
        """Table `handle`, replacing a finished room of the same id; caller holds `lock`."""
        if handle.room in self._rooms:
            self._metrics.room_changed(self._counted[handle.room], None)
        self._rooms[handle.room] = handle
        self._counted[handle.room] = state = handle.state
        self._metrics.room_changed(None, state)

    def remove(self, handle: R) -> None:
        with self.lock:
            if self._rooms.get(handle.room) is handle:
                del self._rooms[handle.room]
                self._metrics.room_changed(self._counted.pop(handle.room), None)

    def changed(self, handle: R, old: RoomState, new: RoomState) -> None:
        """Record a state change of `handle` (only tabled rooms count; see the class docstring for why `old`
        is not what is taken off the gauge)."""
        with self.lock:
            if self._rooms.get(handle.room) is handle:
                counted, now = self._counted[handle.room], handle.state
                if counted != now:
                    self._counted[handle.room] = now
                    self._metrics.room_changed(counted, now)
        if new == RoomState.FAILED and handle.failure is not None:
            self._metrics.failed(handle.failure.kind)

    def all(self) -> list[R]:
        with self.lock:
            return list(self._rooms.values())

    def counts(self) -> dict[RoomState, int]:
        counts = {s: 0 for s in RoomState}
        for r in self.all():
            counts[r.state] += 1
        return counts

    def check(self, now: float, linger: float) -> None:
        """Fail rooms past their state's deadline; forget rooms finished more than `linger` seconds ago."""
        for r in self.all():
            r.tracker.check_deadline(now)
            finished = r.tracker.finished_at
            if finished is not None and now - finished > linger:
                r.release()

    def fail_all(self, message: str) -> None:
        for r in self.all():
            r.tracker.fail(FailureKind.SHUTDOWN, message)
