"""Room states, failures, and the deadline-carrying state machine both sides use.

Bootstrapping -> WaitingForInput -> Transferring -> Success | Failed(reason). Terminal states are
sticky: the first terminal transition wins, later ones are ignored. Every non-terminal state has a
deadline (TransferConfig); Transferring's is re-armed on each unit of progress.
"""
from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kv_transfer.config import TransferConfig

log = logging.getLogger("kv_transfer")


class RoomState(enum.IntEnum):
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4
    FAILED = 5

    @property
    def terminal(self) -> bool:
        return self in (RoomState.SUCCESS, RoomState.FAILED)


class FailureKind(str, enum.Enum):
    """Low-cardinality failure reasons (the `reason` label of the failures metric)."""

    TIMEOUT = "timeout"
    PEER_DEAD = "peer_dead"
    PEER_UNREACHABLE = "peer_unreachable"
    ABORTED_LOCAL = "aborted_local"
    ABORTED_REMOTE = "aborted_remote"
    TRANSFER_IO = "transfer_io"
    REFUSED = "refused"
    AUX_MISMATCH = "aux_mismatch"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    message: str
    error: Exception | None = None  # the typed error behind it, when there is one

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.message}"


Listener = Callable[["RoomTracker", RoomState, RoomState], None]


class RoomTracker:
    """Thread-safe state of one room on one side, with the current state's deadline."""

    def __init__(self, room: int, config: TransferConfig, on_change: Listener | None = None) -> None:
        self.room = room
        self._config = config
        self._lock = threading.Lock()
        self._state = RoomState.BOOTSTRAPPING
        self._failure: Failure | None = None
        self._on_change = on_change
        self._entered = time.monotonic()
        self._deadline = self._entered + config.bootstrap_timeout
        self.created = self._entered
        self.finished_at: float | None = None  # monotonic time it became terminal

    @property
    def state(self) -> RoomState:
        return self._state

    @property
    def failure(self) -> Failure | None:
        return self._failure

    @property
    def deadline(self) -> float:
        return self._deadline

    def advance(self, new: RoomState) -> bool:
        """Move forward to a non-failure state; False (no change) if already there, past it or terminal."""
        assert new != RoomState.FAILED, "use fail()"
        with self._lock:
            old = self._state
            if old.terminal or new <= old:
                return False
            self._state = new
            self._entered = time.monotonic()
            if new.terminal:
                self.finished_at = self._entered
            else:
                self._deadline = self._entered + self._config.deadline_for(new.name)
        self._notify(old, new)
        return True

    def progress(self) -> None:
        """Re-arm the Transferring deadline after a unit of progress."""
        with self._lock:
            if self._state == RoomState.TRANSFERRING:
                self._deadline = time.monotonic() + self._config.transfer_timeout

    def fail(self, kind: FailureKind, message: str, error: Exception | None = None) -> bool:
        """Move to Failed; False if the room was already terminal."""
        with self._lock:
            old = self._state
            if old.terminal:
                return False
            self._state = RoomState.FAILED
            self._failure = Failure(kind, message, error)
            self.finished_at = time.monotonic()
        log.info("room failed room=%d reason=%s msg=%s", self.room, kind.value, message,
                 extra={"room": self.room})
        self._notify(old, RoomState.FAILED)
        return True

    def check_deadline(self, now: float) -> bool:
        """Fail the room if its state's deadline passed; True if it did."""
        state = self._state
        if state.terminal or now < self._deadline:
            return False
        seconds = self._config.deadline_for(state.name)
        return self.fail(FailureKind.TIMEOUT, f"room stayed {state.name} longer than its {seconds:g}s deadline")

    def _notify(self, old: RoomState, new: RoomState) -> None:
        if self._on_change is not None:
            self._on_change(self, old, new)
