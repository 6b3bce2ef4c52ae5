"""How one chunk of a room's pages reaches a decode peer: one PageWriter per peer, chosen once at registration.

- ShmPageWriter: the peer's pool is mapped here; page runs are copied straight into it, checking the room's state
  every 64 pages (so an aborted room stops within one group).
- DirectPageWriter (Mooncake, fake): contiguous runs become transport entries, written in batches of at most
  ``--transfer-max-batch-entries``, checking the room between batches. When the peer offers staging slots and a
  chunk's entries would be small (scattered pages), the chunk goes through StagedPageWriter instead.
- StagedPageWriter: pages are gathered a slot at a time into one local block, written into a free slot of the
  peer as one entry and announced once written; the decode side copies the slot into place and frees it
  (kv_transfer/staging.py). The next slot is gathered while the previous one is on the wire.

A writer runs on the peer's writer thread. It reports through the room (RoomProgress): pages it wrote (and,
for a staged slot, which), and failures; it stops at the first check after the room ended.
"""
from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from kv_transfer.wire.layout import KVLayout, split_batches, write_entries, write_runs
from kv_transfer.page_views import PageViews, copy_pages
from kv_transfer.state import FailureKind

if TYPE_CHECKING:
    from kv_transfer.wire.aux import AuxRecord
    from kv_transfer.metrics import TransferMetrics
    from kv_transfer.staging import StagingSlots
    from kv_transfer.transport import PeerWriter

SHM_GROUP_PAGES = 64  # shm copies this many pages between room-state checks


@dataclass(frozen=True)
class Chunk:
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    first: int  # index of dst_pages[0] in the room's dst_pages
    last: bool
    aux: AuxRecord | None


class RoomProgress(Protocol):
    """What a writer needs of the room whose chunk it writes (KVSender)."""

    room: int

    def ended(self) -> bool: ...

    def progressed(self, count: int, *, announce: bool, staged: tuple[int, int, int] | None = None) -> None:
        """``count`` more pages are in the peer's memory; ``announce``: tell the peer (a staged slot: which)."""

    def fail_write(self, kind: FailureKind, message: str) -> None: ...


class PageWriter(ABC):
    @abstractmethod
    def write(self, room: RoomProgress, chunk: Chunk) -> None:
        """Write the chunk's pages; raises KVTransferError when the transport fails."""


class ShmPageWriter(PageWriter):
    def __init__(self, mapped: tuple[PageViews, PageViews], metrics: TransferMetrics) -> None:
        self.mapped, self.metrics = mapped, metrics

    def write(self, room: RoomProgress, chunk: Chunk) -> None:
        for i in range(0, len(chunk.src_pages), SHM_GROUP_PAGES):
            if room.ended():
                return  # aborted or timed out: the decode side may reuse its pages, stop copying
            end = i + SHM_GROUP_PAGES
            self.metrics.add_bytes(copy_pages(*self.mapped, chunk.src_pages[i:end], chunk.dst_pages[i:end]))
        if not room.ended():
            room.progressed(len(chunk.src_pages), announce=not chunk.last)


class DirectPageWriter(PageWriter):
    def __init__(self, src: KVLayout, dst: KVLayout, transport: PeerWriter, metrics: TransferMetrics,
                 max_batch_entries: int, staged: StagedPageWriter | None = None) -> None:
        self.src, self.dst, self.transport, self.metrics = src, dst, transport, metrics
        self.max_batch_entries = max_batch_entries
        self.staged = staged

    def write(self, room: RoomProgress, chunk: Chunk) -> None:
        runs = write_runs(self.src, self.dst, chunk.src_pages, chunk.dst_pages)
        if self.staged is not None and self.staged.worth_it(len(chunk.src_pages) * self.src.page_bytes / len(runs)):
            self.staged.write(room, chunk)
            return
        for batch in split_batches(write_entries(self.src, self.dst, runs), self.max_batch_entries):
            if room.ended():
                return  # aborted or timed out: stop writing
            self.transport.write(batch)
            self.metrics.add_bytes(sum(e[2] for e in batch))
        if not room.ended():
            room.progressed(len(chunk.src_pages), announce=not chunk.last)


@dataclass(frozen=True)
class _Pending:
    """A staged write on the wire: wait() for it, then announce slot `slot` = dst_pages[first:first + count]."""
    wait: Callable[[], None]
    slot: int
    first: int
    count: int
    nbytes: int


class StagedPageWriter(PageWriter):
    def __init__(self, slots: StagingSlots, metrics: TransferMetrics, worker: str, slot_timeout: float) -> None:
        self.slots, self.metrics, self.worker, self.slot_timeout = slots, metrics, worker, slot_timeout

    def worth_it(self, mean_entry_bytes: float) -> bool:
        return self.slots.worth_it(mean_entry_bytes)

    def write(self, room: RoomProgress, chunk: Chunk) -> None:
        """A slot at a time. Stops at the first slot after the room ended; a slot whose write failed is retired,
        since a late write could still land in it."""
        slots, per_slot = self.slots, self.slots.pages_per_slot
        pending: _Pending | None = None
        try:
            for k, i in enumerate(range(0, len(chunk.src_pages), per_slot)):
                if room.ended():
                    return
                slot = slots.acquire(0.0, lambda: False) if pending is not None else None
                if slot is None:
                    if pending is not None:  # the peer may be waiting to hear of it before it frees anything
                        done, pending = pending, None
                        self._finish(room, done)
                    slot = slots.acquire(self.slot_timeout, room.ended)
                if slot is None:
                    if slots.closed:
                        room.fail_write(FailureKind.PEER_DEAD, f"decode peer {self.worker} went away mid-transfer")
                    else:  # (a no-op when the room already ended)
                        room.fail_write(FailureKind.TIMEOUT, f"decode peer {self.worker} freed no staging slot in "
                                                       f"{self.slot_timeout:g}s")
                    return
                src = chunk.src_pages[i:i + per_slot]
                try:
                    address, nbytes = slots.gather(src, buffer=k % 2)
                except BaseException:
                    slots.give_back(slot, written=False)
                    raise
                try:
                    wait = slots.start_write(slot, address, nbytes)
                except BaseException:
                    slots.give_back(slot, written=True)
                    raise
                started = _Pending(wait, slot, chunk.first + i, len(src), nbytes)
                if pending is not None:
                    done, pending = pending, started
                    self._finish(room, done)  # on failure, `finally` still finishes `started`
                else:
                    pending = started
        finally:
            if pending is not None:
                self._finish(room, pending, quiet=sys.exc_info()[0] is not None)

    def _finish(self, room: RoomProgress, w: _Pending, *, quiet: bool = False) -> None:
        """Wait for a staged write, then announce it (also when the room ended meanwhile: the decode side must
        hear of the slot to free it). `quiet`: another error is already on its way, so a failure here only
        retires the slot."""
        try:
            w.wait()
        except BaseException:
            self.slots.give_back(w.slot, written=True)
            if quiet:
                return
            raise
        self.metrics.add_bytes(w.nbytes)
        self.metrics.add_staged_bytes(w.nbytes)
        self.slots.announce(w.slot)
        room.progressed(w.count, announce=True, staged=(w.slot, w.first, w.count))
