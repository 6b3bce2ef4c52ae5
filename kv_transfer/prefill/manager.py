"""PrefillTransferManager: the prefill worker's side of kv_transfer (one per worker).

Serves the bootstrap handshake on the bootstrap port, keeps the registered decode peers and the
rooms, and runs the deadline/heartbeat monitor. The worker creates one KVSender per request.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kv_transfer.wire.aux import AuxStaging
from kv_transfer.prefill.bootstrap_server import start_bootstrap_server
from kv_transfer.config import MAX_STAGING_SLOT_BYTES, MAX_STAGING_SLOTS, TransferConfig
from kv_transfer.wire.errors import (
    DuplicateRoomError, InvalidRoomError, PageIndexError, UnknownPeerError, UnknownRoomError,
)
from kv_transfer.wire.layout import KVLayout
from kv_transfer.metrics import TransferMetrics
from kv_transfer.prefill.peers import DecodePeer
from kv_transfer.rooms import RoomTable
from kv_transfer.page_views import PageViews, matched_views
from kv_transfer.prefill.page_writers import DirectPageWriter, PageWriter, ShmPageWriter, StagedPageWriter
from kv_transfer.prefill.sender import KVSender, publish
from kv_transfer.staging import StagingSlots
from kv_transfer.state import FailureKind, RoomState
from kv_transfer.ticker import Ticker
from kv_transfer.transport import PeerWriter
from kv_transfer.transport.mooncake import MooncakeWriter
from kv_transfer.transport.select import SendSide
from kv_transfer.transport.shm import ShmWriter
from kv_transfer.wire.messages import aux_from_msg, check_room_id, layout_from_msg, offer_from_msg

log = logging.getLogger("kv_transfer")


class PrefillTransferManager:
    def __init__(self, config: TransferConfig, layout: KVLayout, *, bootstrap_port: int,
                 worker_id: str = "prefill", bootstrap_host: str = "0.0.0.0",
                 metrics: TransferMetrics | None = None, server_threads: int = 64) -> None:
        self.config = config
        self.layout = layout
        self.worker_id = worker_id
        self.metrics = metrics or TransferMetrics("prefill")
        self._aux_staging = AuxStaging(config.aux_staging_slots)
        self._source_views: PageViews | None = None  # this pool as numpy views, for staged and shm copies
        self._send_side = SendSide(config, layout.regions() + [self._aux_staging.region])
        self._rooms: RoomTable[KVSender] = RoomTable(self.metrics)
        self._lock = threading.Lock()  # guards _peers and _closed
        self._peers: dict[str, DecodePeer] = {}
        self._closed = False
        self._server, self.port = start_bootstrap_server(self, bootstrap_host, bootstrap_port, server_threads)
        self._monitor = Ticker(f"kv-monitor-{worker_id}", config.monitor_interval, self._tick)
        log.info("prefill transfer manager up worker=%s bootstrap_port=%d backend=%s",
                 worker_id, self.port, config.backend, extra={"worker": worker_id})

    # --- worker API ----------------------------------------------------------------------------
    def create_sender(self, room: int) -> KVSender:
        """The sender for `room`; DuplicateRoomError if the worker already holds one in flight."""
        check_room_id(room)
        with self._rooms.lock:
            existing = self._rooms.peek(room)
            if existing is not None and existing.claimed and not existing.state.terminal:
                raise DuplicateRoomError(f"room {room} is already in flight on this prefill worker", room=room)
            if existing is None or existing.claimed:
                existing = self._new_room(room)
        existing.claim()
        return existing

    def sender(self, room: int) -> KVSender:
        found = self._rooms.get(room)
        if found is None or not found.claimed:
            raise UnknownRoomError(f"room {room} has no sender on this prefill worker", room=room)
        return found

    def rooms_by_state(self) -> dict[RoomState, int]:
        return self._rooms.counts()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
        self._monitor.stop()
        self._rooms.fail_all("prefill transfer manager closed")
        for p in peers:
            p.close()
        self._server.stop(grace=0.5)

    # --- called by the bootstrap servicer --------------------------------------------------------
    def register_peer(self, req: Any) -> str:
        remote = layout_from_msg(req.layout)
        self.layout.check_compatible(remote, peer=req.worker)
        writer = self._send_side.writer_for(offer_from_msg(req.offer), req.worker)
        try:
            staging = self._staging_for(req, writer) if isinstance(writer, MooncakeWriter) else None
            pages = self._page_writer(writer, remote, staging, req.worker)
            peer = DecodePeer(req.peer_id, req.worker, remote, aux_from_msg(req.aux), writer,
                              self._aux_staging, self.metrics, pages, staging)
        except BaseException:
            writer.close()  # its mappings, registrations and (per-peer) Mooncake engine
            raise
        with self._lock:
            old = self._peers.pop(req.peer_id, None)
            self._peers[req.peer_id] = peer
        if old is not None:
            self._drop_peer(old, "re-registered")
        log.info("decode peer registered peer=%s transport=%s", req.worker, writer.transport,
                 extra={"worker": self.worker_id, "peer": req.worker})
        return writer.transport

    def staging_done(self, peer_id: str, slot: int) -> None:
        peer = self.peer(peer_id)
        if peer.staging is None:
            raise PageIndexError(f"decode peer {peer.worker} freed staging slot {slot}, but nothing is staged to it")
        peer.staging.release(slot)

    def peer(self, peer_id: str) -> DecodePeer:
        with self._lock:
            found = self._peers.get(peer_id)
        if found is None or not found.alive:
            raise UnknownPeerError(f"decode peer {peer_id} is not registered here (or was declared dead); "
                                   "register again")
        return found

    def open_room(self, req: Any) -> None:
        peer = self.peer(req.peer_id)
        room = check_room_id(req.room)
        dst = peer.layout.check_pages(req.dst_pages, "destination", room=room)
        if len(set(dst)) != len(dst):
            raise PageIndexError(f"room {room}: a destination page is listed twice", room=room)
        peer.aux.slot_address(req.aux_slot, room=room)  # range check
        with self._rooms.lock:
            entry = self._rooms.peek(room)
            if entry is not None and entry.peer is not None:
                if not entry.state.terminal:
                    raise DuplicateRoomError(f"room {room} is already in flight on this prefill worker", room=room)
                entry = None
            if entry is not None and entry.state.terminal:
                raise InvalidRoomError(f"room {room} already ended here: {entry.failure_reason}", room=room)
            if entry is None:
                entry = self._new_room(room)
        entry.attach(peer, dst, req.aux_slot, req.held_prefix_tokens)

    def abort_room(self, peer_id: str, room: int, reason: str) -> None:
        entry = self._rooms.get(room)
        if entry is None or entry.peer is None or entry.peer.peer_id != peer_id:
            raise UnknownRoomError(f"room {room} is not open for this decode peer", room=room)
        entry.tracker.fail(FailureKind.ABORTED_REMOTE, f"aborted by decode: {reason}")

    def peer_disconnected(self, peer: DecodePeer, why: str) -> None:
        with self._lock:
            if self._peers.get(peer.peer_id) is peer:
                del self._peers[peer.peer_id]
        self._drop_peer(peer, why)

    # --- internals --------------------------------------------------------------------------------
    def _page_writer(self, writer: PeerWriter, remote: KVLayout, staging: StagingSlots | None,
                     worker: str) -> PageWriter:
        """Chosen once per peer: copies into its mapped pool (shm), else transport writes, staged when it pays."""
        if isinstance(writer, ShmWriter):
            return ShmPageWriter(matched_views(self._views(), writer.map_pool(remote)), self.metrics)
        staged = None if staging is None else StagedPageWriter(staging, self.metrics, worker,
                                                                self.config.transfer_timeout)
        return DirectPageWriter(self.layout, remote, writer, self.metrics, self.config.max_batch_entries, staged)

    def _staging_for(self, req: Any, writer: MooncakeWriter) -> StagingSlots | None:
        """Stage scattered pages to a Mooncake peer when it offers slots and both sides allow it (shm and fake
        copy directly, where a bounce only costs)."""
        offer = req.staging if req.HasField("staging") else None
        if offer is None or not offer.num_slots or not self.config.staging_slot_bytes:
            return None
        if offer.slot_bytes > MAX_STAGING_SLOT_BYTES or offer.num_slots > MAX_STAGING_SLOTS:
            log.warning("decode peer offers %d staging slots of %d bytes, more than this side takes (%d of %d); "
                        "writing pages directly peer=%s", offer.num_slots, offer.slot_bytes, MAX_STAGING_SLOTS,
                        MAX_STAGING_SLOT_BYTES, req.worker, extra={"worker": self.worker_id, "peer": req.worker})
            return None
        source = self._views()
        if offer.slot_bytes < source.bytes_per_page:
            log.warning("decode peer's staging slots are smaller than one page over all layers; writing pages "
                        "directly peer=%s", req.worker, extra={"worker": self.worker_id, "peer": req.worker})
            return None
        slots = StagingSlots(offer.base, offer.slot_bytes, offer.num_slots, source, writer.start_write)
        writer.register_source(slots.local_region)
        return slots

    def _views(self) -> PageViews:
        if self._source_views is None:
            self._source_views = PageViews(self.layout)
        return self._source_views

    def _new_room(self, room: int) -> KVSender:
        """Create and table a room; the caller holds self._rooms.lock."""
        sender = KVSender(room, self.config, self.layout, self._on_change, self._rooms.remove)
        self._rooms.put(sender)
        return sender

    def _on_change(self, sender: KVSender, old: RoomState, new: RoomState) -> None:
        self._rooms.changed(sender, old, new)
        publish(sender, new)

    def _drop_peer(self, peer: DecodePeer, why: str) -> None:
        was_alive = peer.alive
        peer.close()
        rooms = [r for r in self._rooms.all() if r.peer is peer]
        failed = sum(r.tracker.fail(FailureKind.PEER_DEAD, f"decode peer {peer.worker} {why}") for r in rooms)
        if was_alive:
            log.log(logging.WARNING if failed else logging.INFO, "decode peer dropped peer=%s why=%s rooms_failed=%d",
                    peer.worker, why, failed, extra={"worker": self.worker_id, "peer": peer.worker})

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [p for p in self._peers.values() if now - p.last_seen > self.config.heartbeat_timeout]
            for p in stale:
                del self._peers[p.peer_id]
        for p in stale:
            self._drop_peer(p, f"sent no heartbeat for {self.config.heartbeat_timeout:g}s")
        self._rooms.check(now, self.config.room_linger)
