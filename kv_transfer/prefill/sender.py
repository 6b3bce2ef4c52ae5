"""KVSender: one room on the prefill side.

The prefill worker gets it from PrefillTransferManager.create_sender(room) when the request
arrives; the decode side's room info may have arrived before or arrives after. poll() says
WaitingForInput once it is here; then `dst_pages` and `held_prefix_tokens` tell what to send.
send() validates on the caller's thread and queues the chunk to the peer's writer thread, so it
never blocks on the network. Chunks map in order onto dst_pages and are written by the peer's PageWriter
(kv_transfer/prefill/page_writers.py: shm, direct or staged, chosen once per peer); the last one also writes the aux
record, and Success is reported to the decode side only after that write completed. A payload too large for an
aux record (a prompt's logprobs) rides on the Success event itself (`extra_payload`, up to MAX_EXTRA_PAYLOAD).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kv_transfer.wire.aux import MAX_EXTRA_PAYLOAD, RECORD_SIZE, AuxRecord
from kv_transfer.config import TransferConfig
from kv_transfer.wire.errors import InvalidRoomError, KVTransferError, PageIndexError
from kv_transfer.wire.layout import KVLayout
from kv_transfer.prefill.page_writers import Chunk
from kv_transfer.rooms import RoomHandle
from kv_transfer.state import FailureKind, RoomState

if TYPE_CHECKING:
    from kv_transfer.prefill.peers import DecodePeer

log = logging.getLogger("kv_transfer")

class KVSender(RoomHandle):
    def __init__(self, room: int, config: TransferConfig, layout: KVLayout,
                 on_change: Callable[[Any, RoomState, RoomState], None],
                 on_release: Callable[[Any], None]) -> None:
        super().__init__(room, config, on_change, on_release)
        self._config = config
        self._layout = layout
        self._lock = threading.Lock()
        self.claimed = False           # the prefill worker holds this sender
        self.peer: DecodePeer | None = None
        self.dst_pages: tuple[int, ...] | None = None
        self.aux_slot = 0
        self.held_prefix_tokens: int | None = None
        self.pages_queued = 0
        self.pages_done = 0
        self._last_queued = False
        self.extra_payload = b""  # sent with Success
        self.started: float | None = None

    # --- caller API (poll, state, failure, failure_reason, release: see RoomHandle) ---------------
    def send(self, src_pages: Sequence[int], *, last: bool = False, first_token_id: int | None = None,
             cached_tokens: int = 0, aux_payload: bytes = b"", extra_payload: bytes = b"") -> bool:
        """Queue the next chunk: src_pages are written into the next len(src_pages) dst_pages.

        With last=True the chunk must complete dst_pages, and first_token_id/cached_tokens (and an
        optional aux_payload, which must fit the decode side's aux records) form the aux record; extra_payload
        (at most MAX_EXTRA_PAYLOAD bytes) reaches the decode side with Success.
        Returns False (nothing queued) if the room already failed; raises PageIndexError /
        InvalidRoomError for bad input, before anything is written.
        """
        with self._lock:
            state = self._tracker.state
            if state == RoomState.FAILED:
                return False
            if state not in (RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING) or self.dst_pages is None:
                raise InvalidRoomError(f"room {self.room} is {state.name}; send() needs WaitingForInput "
                                       "(poll until the decode side's page list has arrived)", room=self.room)
            if self._last_queued:
                raise InvalidRoomError(f"room {self.room}: the last chunk was already sent", room=self.room)
            src = self._layout.check_pages(src_pages, "source", room=self.room)
            end = self.pages_queued + len(src)
            if end > len(self.dst_pages):
                raise PageIndexError(f"room {self.room}: {end} pages sent but the decode side reserved "
                                     f"{len(self.dst_pages)}", room=self.room)
            if last and end != len(self.dst_pages):
                raise PageIndexError(f"room {self.room}: last chunk ends at page {end} of "
                                     f"{len(self.dst_pages)} reserved; send every page", room=self.room)
            aux = None
            if last:
                if first_token_id is None:
                    raise InvalidRoomError(f"room {self.room}: the last chunk needs first_token_id", room=self.room)
                aux = AuxRecord(int(first_token_id), int(cached_tokens), self.room, bytes(aux_payload))
                room_bytes = self.peer.aux.record_bytes if self.peer is not None else RECORD_SIZE
                if RECORD_SIZE + len(aux.payload) > room_bytes:
                    raise PageIndexError(f"room {self.room}: aux payload of {len(aux.payload)} bytes does not fit "
                                         f"the decode side's {room_bytes}-byte aux records", room=self.room)
                if len(extra_payload) > MAX_EXTRA_PAYLOAD:
                    raise PageIndexError(f"room {self.room}: extra payload of {len(extra_payload)} bytes exceeds "
                                         f"{MAX_EXTRA_PAYLOAD}", room=self.room)
                self.extra_payload = bytes(extra_payload)
            chunk = Chunk(src, self.dst_pages[self.pages_queued:end], self.pages_queued, last, aux)
            self.pages_queued = end
            self._last_queued = last
            if self.started is None:
                self.started = time.monotonic()
            self._tracker.advance(RoomState.TRANSFERRING)
            self._tracker.progress()  # a new chunk is progress: the no-progress deadline restarts
            peer = self.peer
        assert peer is not None
        peer.writes.submit(lambda: self._write_chunk(peer, chunk))
        return True

    def abort(self, reason: str) -> None:
        """Stop writing; the decode side hears of it. The caller may then free its pages."""
        self._tracker.fail(FailureKind.ABORTED_LOCAL, f"aborted by prefill: {reason}")

    # --- manager / writer side ----------------------------------------------------------------
    def attach(self, peer: "DecodePeer", dst_pages: tuple[int, ...], aux_slot: int, held: int) -> None:
        with self._lock:
            self.peer, self.dst_pages, self.aux_slot, self.held_prefix_tokens = peer, dst_pages, aux_slot, held
            ready = self.claimed
        if ready:
            self._tracker.advance(RoomState.WAITING_FOR_INPUT)

    def claim(self) -> None:
        with self._lock:
            self.claimed = True
            ready = self.peer is not None
        if ready:
            self._tracker.advance(RoomState.WAITING_FOR_INPUT)

    # --- what the peer's page writer sees of this room (kv_transfer/prefill/page_writers.py: RoomProgress) -----------
    def ended(self) -> bool:
        return self._tracker.state.terminal

    def progressed(self, count: int, *, announce: bool, staged: tuple[int, int, int] | None = None) -> None:
        self.pages_done += count
        self._tracker.progress()
        if announce:
            publish(self, RoomState.TRANSFERRING, staged)

    def fail_write(self, kind: FailureKind, message: str) -> None:
        self._tracker.fail(kind, message)

    def _write_chunk(self, peer: "DecodePeer", chunk: Chunk) -> None:
        """Runs on the peer's writer thread."""
        try:
            self._do_write(peer, chunk)
        except KVTransferError as exc:
            exc.room = self.room
            self._tracker.fail(FailureKind.TRANSFER_IO, f"{exc.message} (peer {peer.worker})", exc)
        except Exception as exc:  # a transport bug must still fail the room, never vanish
            log.exception("unexpected write error room=%d peer=%s", self.room, peer.worker)
            self._tracker.fail(FailureKind.TRANSFER_IO, f"unexpected {type(exc).__name__}: {exc}", exc)

    def _do_write(self, peer: "DecodePeer", chunk: Chunk) -> None:
        peer.pages.write(self, chunk)
        if chunk.last and not self._tracker.state.terminal:
            self._write_aux(peer, chunk)

    def _write_aux(self, peer: "DecodePeer", chunk: Chunk) -> None:
        """The last chunk's aux record, then Success (reported to the decode side by the manager)."""
        assert chunk.aux is not None
        aux_staging = peer.aux_staging
        slot = aux_staging.acquire(chunk.aux, self._config.rpc_timeout)
        try:
            dst = peer.aux.slot_address(self.aux_slot, room=self.room)
            peer.writer.write([(aux_staging.address(slot), dst, RECORD_SIZE + len(chunk.aux.payload))])
        finally:
            aux_staging.release(slot)
        if self._tracker.advance(RoomState.SUCCESS) and self.started is not None:
            peer.metrics.observe_transfer(time.monotonic() - self.started)


def publish(sender: KVSender, state: RoomState, staged: tuple[int, int, int] | None = None) -> None:
    """The one place the prefill side tells a decode peer about a room: each state change (the manager's
    on_change), and each chunk or staged slot written while Transferring (``staged``: which slot holds which of
    the room's pages)."""
    peer = sender.peer
    if peer is None or not peer.alive:
        return
    failure = sender.failure
    kind, reason = (failure.kind.value, failure.message) if failure and state == RoomState.FAILED else ("", "")
    extra = sender.extra_payload if state == RoomState.SUCCESS else b""
    peer.publish(sender.room, state, kind=kind, reason=reason, pages_done=sender.pages_done, staged=staged,
                 extra_payload=extra)
