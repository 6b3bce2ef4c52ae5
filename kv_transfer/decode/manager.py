"""DecodeTransferManager: the decode worker's side of kv_transfer (one per worker).

Owns the transport registration of the KV pool and aux array, one PeerLink per prefill bootstrap
address, the rooms, and the deadline/heartbeat monitor.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

from kv_transfer.wire.aux import AuxLayout
from kv_transfer.config import TransferConfig
from kv_transfer.wire.errors import ConfigError, DuplicateRoomError, PeerUnreachableError, UnknownRoomError
from kv_transfer.wire.layout import KVLayout
from kv_transfer.metrics import TransferMetrics
from kv_transfer.decode.peer_link import PeerLink
from kv_transfer.decode.receiver import KVReceiver
from kv_transfer.rooms import RoomTable
from kv_transfer.shm import SharedSegment
from kv_transfer.staging import PageViews, StagingArea
from kv_transfer.state import FailureKind, RoomState
from kv_transfer.ticker import Ticker
from kv_transfer.transport.select import ReceiveSide
from kv_transfer.wire.messages import aux_to_msg, check_room_id, layout_to_msg, offer_to_msg, pb

log = logging.getLogger("kv_transfer")


class DecodeTransferManager:
    def __init__(self, config: TransferConfig, layout: KVLayout, aux: AuxLayout, *, worker_id: str = "decode",
                 segments: Sequence[SharedSegment] = (), metrics: TransferMetrics | None = None) -> None:
        self.config = config
        self.layout = layout
        self.aux = aux
        self.worker_id = worker_id
        self.metrics = metrics or TransferMetrics("decode")
        self._receive_side = ReceiveSide(config, layout.regions() + [(aux.base, aux.total_bytes)], list(segments))
        self._rooms: RoomTable[KVReceiver] = RoomTable(self.metrics)
        self._lock = threading.Lock()  # guards _links and _closed; taken inside _rooms.lock, never around it
        self._links: dict[str, PeerLink] = {}
        self._room_links: dict[KVReceiver, PeerLink] = {}  # each room's link, until the room is released
        self._closed = False
        # Staging slots, one area per link (only Mooncake peers stage). An area is never freed, since Mooncake's
        # TCP server writes wherever a peer says; a dead link's area is reused by a later link only after a
        # cool-down, so a write the old prefill-side writer still had on the wire cannot land in a new link's slot.
        self._spare_staging: list[tuple[float, StagingArea]] = []
        self._pool_views: PageViews | None = None
        if config.staging_slot_bytes and self._receive_side.mooncake is not None:
            self._pool_views = PageViews(layout)
            if config.staging_slot_bytes < self._pool_views.bytes_per_page:
                raise ConfigError(f"--transfer-staging-slot-bytes {config.staging_slot_bytes} cannot hold one page "
                                  f"over all layers ({self._pool_views.bytes_per_page} bytes); raise it or pass 0")
        self._monitor = Ticker(f"kv-monitor-{worker_id}", config.monitor_interval, self._tick)
        log.info("decode transfer manager up worker=%s backend=%s", worker_id, config.backend,
                 extra={"worker": worker_id})

    # --- worker API ----------------------------------------------------------------------------
    def create_receiver(self, room: int, bootstrap_host: str, bootstrap_port: int) -> KVReceiver:
        """A receiver in Bootstrapping; connects to the prefill side in the background."""
        check_room_id(room)
        with self._rooms.lock:
            existing = self._rooms.peek(room)
            if existing is not None and not existing.state.terminal:
                raise DuplicateRoomError(f"room {room} is already in flight on this decode worker", room=room)
            with self._lock:
                link = self._link(bootstrap_host, bootstrap_port)
            receiver = KVReceiver(room, self.config, self.layout, self.aux, self._on_change, self._release,
                                  link.open_room)
            with self._lock:
                if existing is not None:  # a finished room of the same id, replaced in the table: forget its link
                    self._room_links.pop(existing, None)
                self._room_links[receiver] = link
            self._rooms.put(receiver)
        link.attach(receiver)
        return receiver

    def receiver(self, room: int) -> KVReceiver:
        found = self._rooms.get(room)
        if found is None:
            raise UnknownRoomError(f"room {room} has no receiver on this decode worker", room=room)
        return found

    def connect(self, bootstrap_host: str, bootstrap_port: int, timeout: float | None = None) -> str:
        """Register with a prefill worker now; returns the chosen transport or raises its typed error
        (PeerUnreachableError, LayoutMismatchError, TransportMismatchError...)."""
        with self._lock:
            link = self._link(bootstrap_host, bootstrap_port)
        wait = timeout if timeout is not None else self.config.rpc_timeout + 1.0
        if not link.registered.wait(wait):
            raise PeerUnreachableError(f"prefill {link.address} did not complete registration in {wait:g}s",
                                       peer=link.address)
        if not link.alive:
            assert link.error is not None
            raise link.error
        return link.transport

    def rooms_by_state(self) -> dict[RoomState, int]:
        return self._rooms.counts()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = list(self._links.values())
        self._monitor.stop()
        self._rooms.fail_all("decode transfer manager closed")
        for link in links:
            link.die(FailureKind.SHUTDOWN, "decode transfer manager closed")
        self._receive_side.close()

    # --- internals --------------------------------------------------------------------------------
    def _link(self, host: str, port: int) -> PeerLink:
        """The live link to host:port, opening a new one if needed; caller holds self._lock."""
        key = f"{host}:{port}"
        link = self._links.get(key)
        if link is None or not link.alive:
            if link is not None:
                self._retire_staging(link)
            link = PeerLink(host, port, self.config, self.worker_id, self._register_request, self._staging_area())
            self._links[key] = link
        return link

    def _staging_area(self) -> StagingArea | None:
        """Slots for a new link: a spare area past its cool-down, or a new one; caller holds self._lock."""
        mooncake = self._receive_side.mooncake
        if self._pool_views is None or mooncake is None:
            return None
        cool = time.monotonic() - (self.config.transfer_timeout + self.config.heartbeat_timeout)
        for i, (retired_at, area) in enumerate(self._spare_staging):
            if retired_at < cool:
                del self._spare_staging[i]
                return area
        area = StagingArea(self.config.staging_slot_bytes, self.config.staging_slots, self._pool_views)
        mooncake.register([area.region])
        return area

    def _retire_staging(self, link: PeerLink) -> None:
        """A dead link's slots become spare (reused after the cool-down); caller holds self._lock."""
        if link.staging is not None:
            self._spare_staging.append((time.monotonic(), link.staging))
            link.staging = None

    def _register_request(self, peer_id: str, staging: StagingArea | None) -> Any:
        m = pb()
        offer = m.StagingOffer(base=staging.base, slot_bytes=staging.slot_bytes, num_slots=staging.num_slots) \
            if staging is not None else None
        return m.RegisterPeerRequest(
            peer_id=peer_id, worker=self.worker_id, layout=layout_to_msg(self.layout),
            aux=aux_to_msg(self.aux), offer=offer_to_msg(self._receive_side.offer), staging=offer)

    def _release(self, receiver: KVReceiver) -> None:
        self._rooms.remove(receiver)
        with self._lock:
            link = self._room_links.pop(receiver, None)
        if link is not None:
            link.detach(receiver)

    def _on_change(self, receiver: KVReceiver, old: RoomState, new: RoomState) -> None:
        self._rooms.changed(receiver, old, new)
        if new == RoomState.SUCCESS:
            assert receiver.dst_pages is not None
            self.metrics.add_bytes(len(receiver.dst_pages) * self.layout.page_bytes * 2 * self.layout.num_layers)
            if receiver.started is not None:
                self.metrics.observe_transfer(time.monotonic() - receiver.started)
        elif new == RoomState.FAILED and receiver.failure is not None and receiver.tells_peer and receiver.opened:
            with self._lock:
                link = self._room_links.get(receiver)
            if link is not None and link.alive:
                link.abort_room(receiver.room, receiver.failure.message)

    def _tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            links = list(self._links.values())
            for key in [k for k, link in self._links.items() if not link.alive]:
                self._retire_staging(self._links.pop(key))
        for link in links:
            link.check_silence(now)
        self._rooms.check(now, self.config.room_linger)

