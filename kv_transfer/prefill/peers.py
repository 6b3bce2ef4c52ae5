"""The prefill side's view of one registered decode manager: layout, writer, events, liveness.

Each peer has its own writer thread, so a peer that blocks a transport call (a frozen Mooncake
peer blocks 30-61 s) stalls only its own rooms; their deadlines fail them meanwhile.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from kv_transfer.wire.aux import AuxLayout, AuxStaging
from kv_transfer.wire.layout import KVLayout
from kv_transfer.metrics import TransferMetrics
from kv_transfer.prefill.page_writers import PageWriter
from kv_transfer.staging import StagingSlots
from kv_transfer.state import RoomState
from kv_transfer.transport import PeerWriter
from kv_transfer.wire.messages import pb, state_to_msg

log = logging.getLogger("kv_transfer")


class WriteQueue:
    """A daemon thread running submitted jobs in order until stopped."""

    def __init__(self, name: str) -> None:
        self._jobs: "queue.Queue[Callable[[], None] | None]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # jobs handle their own errors; this keeps the thread alive regardless
                log.exception("write job crashed")


class DecodePeer:
    def __init__(self, peer_id: str, worker: str, layout: KVLayout, aux: AuxLayout, writer: PeerWriter,
                 aux_staging: AuxStaging, metrics: TransferMetrics, pages: PageWriter,
                 staging: StagingSlots | None = None) -> None:
        self.peer_id = peer_id
        self.worker = worker
        self.layout = layout
        self.aux = aux
        self.writer = writer  # the transport (aux records go through it; pages through `pages`)
        self.aux_staging = aux_staging
        self.metrics = metrics
        self.pages = pages  # how a chunk's pages get there: shm, direct or staged (kv_transfer/prefill/page_writers.py)
        self.staging = staging  # the peer's staging slots, when scattered pages are staged
        self.events: "queue.Queue[Any]" = queue.Queue()
        self.last_seen = time.monotonic()
        self.alive = True
        self.writes = WriteQueue(f"kv-write-{worker}")

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def publish(self, room: int, state: RoomState, *, kind: str = "", reason: str = "", pages_done: int = 0,
                staged: tuple[int, int, int] | None = None, extra_payload: bytes = b"") -> None:
        m = pb()
        self.events.put(m.RoomEvent(room=room, state=state_to_msg(state), failure_kind=kind, reason=reason,
                                    pages_done=pages_done, extra_payload=extra_payload,
                                    staged=m.StagedPages(slot=staged[0], first=staged[1], count=staged[2])
                                    if staged else None))

    def close(self) -> None:
        """Mark dead and stop the writer thread once its queue drains (rooms already failed skip)."""
        if not self.alive:
            return
        self.alive = False
        if self.staging is not None:
            self.staging.close()  # wakes a writer waiting for a slot
        self.events.put(None)  # wakes the Subscribe stream so it ends
        # Unmapping while a write runs would crash, so the writer closes on its own thread.
        self.writes.submit(self.writer.close)
        self.writes.stop()
