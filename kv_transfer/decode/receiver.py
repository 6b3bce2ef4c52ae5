"""KVReceiver: one room on the decode side, a state machine fed events.

Created by DecodeTransferManager.create_receiver(room, host, port); the worker then calls
init(dst_pages, aux_slot, held_prefix_tokens) and polls. Success is reached only when the
prefill side reported every page written and the aux record in our memory carries this room's
id; anything else ends in Failed(reason), after which the worker frees the pages.

What happens on the wire reaches it as typed events (``feed``), which the room's PeerLink decodes from the
prefill side's stream and its own calls: Opened, Refused/PeerFailed, Remote (a state the prefill side
reported) and Staged (a slot of pages to copy into place). It never calls the link; ``init`` hands the room to
the manager's ``on_init``, which asks the link to open it (``open_request`` says what to send).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kv_transfer.wire.aux import AuxLayout, AuxRecord
from kv_transfer.config import TransferConfig
from kv_transfer.wire.errors import InvalidRoomError, PageIndexError
from kv_transfer.wire.layout import KVLayout
from kv_transfer.rooms import RoomHandle
from kv_transfer.state import FailureKind, RoomState

if TYPE_CHECKING:
    from kv_transfer.staging import StagingArea

log = logging.getLogger("kv_transfer")

# How a failure the prefill side reports reads from the decode side.
_REMOTE_KIND = {
    FailureKind.ABORTED_LOCAL.value: FailureKind.ABORTED_REMOTE,
    FailureKind.ABORTED_REMOTE.value: FailureKind.ABORTED_LOCAL,
}


@dataclass(frozen=True)
class OpenRequest:
    """What OpenRoom tells the prefill side."""
    room: int
    dst_pages: tuple[int, ...]
    aux_slot: int
    held_prefix_tokens: int


@dataclass(frozen=True)
class Opened:
    """The prefill side accepted the room."""


@dataclass(frozen=True)
class PeerFailed:
    """The link failed the room: the prefill side refused it, or the link died (the prefill side knows)."""
    kind: FailureKind
    message: str
    error: Exception | None = None


@dataclass(frozen=True)
class Remote:
    """A state the prefill side reported for the room (and, with Success, its page count and extra payload)."""
    state: RoomState
    pages_done: int = 0
    failure_kind: str = ""
    reason: str = ""
    extra_payload: bytes = b""


@dataclass(frozen=True)
class Staged:
    """Slot ``slot`` of ``area`` holds dst_pages[first:first + count]."""
    area: "StagingArea | None"
    slot: int
    first: int
    count: int


RoomEvent = Opened | PeerFailed | Remote | Staged


class KVReceiver(RoomHandle):
    def __init__(self, room: int, config: TransferConfig, layout: KVLayout, aux: AuxLayout,
                 on_change: Callable[[Any, RoomState, RoomState], None],
                 on_release: Callable[[Any], None],
                 on_init: Callable[["KVReceiver"], None]) -> None:
        super().__init__(room, config, on_change, on_release)
        self._layout = layout
        self._aux = aux
        self._on_init = on_init
        self._lock = threading.Lock()
        self.dst_pages: tuple[int, ...] | None = None
        self.aux_slot: int | None = None
        self.held_prefix_tokens = 0
        self.aux_record: AuxRecord | None = None  # set on Success
        self.extra_payload = b""  # what the Success event carried
        self.opened = False  # OpenRoom was sent, so the prefill side may know the room
        self.started: float | None = None
        self._tell_peer = True
        self._unstaging = threading.RLock()  # held while staged pages are copied into dst_pages

    # --- caller API (state, failure, failure_reason, release: see RoomHandle) -----------------------
    def poll(self) -> RoomState:
        """Current state. Waits only for a staged copy into this room's pages that is under way (milliseconds),
        so once it says Failed no copy can still land in pages the worker is about to free."""
        with self._unstaging:
            return self._tracker.state

    def init(self, dst_pages: Sequence[int], aux_slot: int, held_prefix_tokens: int = 0) -> None:
        """Ask the prefill side to fill `dst_pages` (prompt order, after the held prefix's pages).

        Validates before anything is sent: PageIndexError for a page or aux slot out of range or
        a page listed twice; InvalidRoomError if called twice. On a room that already failed (say,
        the peer was unreachable) it records the pages and returns; poll() reports the failure.
        """
        dst = self._layout.check_pages(dst_pages, "destination", room=self.room)
        if len(set(dst)) != len(dst):
            raise PageIndexError(f"room {self.room}: a destination page is listed twice", room=self.room)
        self._aux.slot_address(aux_slot, room=self.room)
        if held_prefix_tokens < 0:
            raise InvalidRoomError(f"held_prefix_tokens must be >= 0, got {held_prefix_tokens}", room=self.room)
        with self._lock:
            if self.dst_pages is not None:
                raise InvalidRoomError(f"room {self.room}: init() was already called", room=self.room)
            self.dst_pages, self.aux_slot, self.held_prefix_tokens = dst, aux_slot, held_prefix_tokens
            if self._tracker.state.terminal:
                return  # failed meanwhile (e.g. unreachable peer): poll() reports it; nothing to send
        self._aux.clear(aux_slot)
        self._on_init(self)

    def abort(self, reason: str) -> None:
        """Give up on the room; the prefill side hears of it and stops writing. Returns once no staged copy into
        this room's pages is under way, so the caller may free them."""
        with self._unstaging:
            self._tracker.fail(FailureKind.ABORTED_LOCAL, f"aborted by decode: {reason}")

    def release(self) -> None:
        with self._unstaging:  # a staged copy under way finishes first
            super().release()

    # --- manager / link side ------------------------------------------------------------------
    @property
    def tells_peer(self) -> bool:
        """Whether the failure originated here (so the prefill side must be told)."""
        return self._tell_peer

    def open_request(self) -> OpenRequest | None:
        """What to send in OpenRoom, or None when the room already ended; from then on the prefill side may know
        the room (``opened``)."""
        if self._tracker.state.terminal:
            return None
        assert self.dst_pages is not None and self.aux_slot is not None
        self.opened = True
        return OpenRequest(self.room, self.dst_pages, self.aux_slot, self.held_prefix_tokens)

    def feed(self, event: RoomEvent) -> None:
        if isinstance(event, Opened):
            self._tracker.advance(RoomState.WAITING_FOR_INPUT)
        elif isinstance(event, PeerFailed):
            self._fail_from_peer(event.kind, event.message, event.error)
        elif isinstance(event, Staged):
            self._unstage(event)
        elif event.state == RoomState.FAILED:
            self._fail_from_peer(_remote_kind(event.failure_kind), f"prefill side: {event.reason}")
        elif event.state == RoomState.SUCCESS:
            self.extra_payload = event.extra_payload
            self._finish(event.pages_done)
        elif event.state == RoomState.TRANSFERRING:
            if self.started is None:
                self.started = time.monotonic()
            self._tracker.advance(RoomState.TRANSFERRING)
            self._tracker.progress()
        elif event.state == RoomState.WAITING_FOR_INPUT:
            self._tracker.advance(RoomState.WAITING_FOR_INPUT)

    def _fail_from_peer(self, kind: FailureKind, message: str, error: Exception | None = None) -> None:
        self._tell_peer = False
        if not self._tracker.fail(kind, message, error):
            self._tell_peer = True

    def _unstage(self, ev: Staged) -> None:
        """Copy the staged slot into its pages; a bad announcement fails the room."""
        with self._unstaging:
            if self._tracker.state.terminal:
                return
            dst, first, count = self.dst_pages, ev.first, ev.count
            if ev.area is None or dst is None or count < 1 or first + count > len(dst):
                self._tracker.fail(FailureKind.TRANSFER_IO, f"prefill staged pages [{first}, {first + count}) into "
                                                            f"slot {ev.slot}, which do not fit this room's "
                                                            f"{len(dst or ())} pages or staging slots")
                return
            try:
                ev.area.unstage(ev.slot, dst[first:first + count])
            except PageIndexError as exc:
                self._tracker.fail(FailureKind.TRANSFER_IO, f"bad staged write: {exc.message}", exc)
                return
            self._tracker.progress()

    def _finish(self, pages_done: int) -> None:
        assert self.dst_pages is not None and self.aux_slot is not None
        if pages_done != len(self.dst_pages):
            self._tracker.fail(FailureKind.AUX_MISMATCH, f"prefill reported {pages_done} pages written, "
                                                         f"{len(self.dst_pages)} were reserved")
            return
        record = self._aux.read(self.aux_slot)
        if record.room != self.room:
            self._tracker.fail(FailureKind.AUX_MISMATCH, f"aux slot {self.aux_slot} holds room {record.room}, "
                                                         f"expected {self.room}")
            return
        self.aux_record = record
        self._tracker.advance(RoomState.SUCCESS)


def _remote_kind(value: str) -> FailureKind:
    if value in _REMOTE_KIND:
        return _REMOTE_KIND[value]
    try:
        return FailureKind(value)
    except ValueError:
        return FailureKind.ABORTED_REMOTE
