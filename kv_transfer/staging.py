"""Staged writes: scattered pages cross the wire as one block per slot and are scattered locally.

Mooncake's TCP transport spends about 20 us of CPU per entry, and a page set that is scattered on
either side needs one entry per page per K/V buffer (32 KiB each in a typical layout), which moves
at half the speed of large blocks. With staging, the decode side keeps `staging_slots` registered
slots of `staging_slot_bytes` per prefill peer (`StagingArea`); the prefill side (`StagingSlots`)
gathers up to a slot's worth of pages into one local buffer, writes it into a free slot as a
single entry, and announces it on the room's event stream. The decode side copies the pages into
the room's reserved pages in stream order (so before it can see Success) and frees the slot with
StagingDone. A slot holds, for each K/V buffer in `KVLayout.bases()` order, its pages back to back.
Only Mooncake writers stage: shm and fake copy memory directly, where a bounce would only cost.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import numpy as np

from kv_transfer.wire.errors import ConfigError, PageIndexError
from kv_transfer.page_views import PageViews
from kv_transfer.transport import Entry

# Entries at least this large already reach Mooncake TCP's full speed (measured here: 32 KiB entries
# 0.9 GB/s, 128 KiB 1.8, 1 MiB and up 2.2), so only chunks whose mean entry is smaller are staged.
STAGE_BELOW_ENTRY_BYTES = 128 << 10


class StagingArea:
    """Decode side: the slots one prefill peer writes staged pages into (registered like the KV pool)."""

    def __init__(self, slot_bytes: int, num_slots: int, pool: PageViews) -> None:
        """slot_bytes must hold one page over all layers (the decode manager checks the flag at start)."""
        self.slot_bytes, self.num_slots, self._pool = slot_bytes, num_slots, pool
        self._buf = np.zeros(slot_bytes * num_slots, dtype=np.uint8)  # touched, so no page faults mid-transfer
        self.base = int(self._buf.ctypes.data)

    @property
    def region(self) -> tuple[int, int]:
        return self.base, self._buf.nbytes

    def unstage(self, slot: int, dst_pages: Sequence[int]) -> None:
        """Copy slot `slot`'s pages into `dst_pages` (PageIndexError if the slot cannot hold them)."""
        if not 0 <= slot < self.num_slots or len(dst_pages) * self._pool.bytes_per_page > self.slot_bytes:
            raise PageIndexError(f"staged write of {len(dst_pages)} pages into slot {slot} does not fit "
                                 f"{self.num_slots} slots of {self.slot_bytes} bytes")
        start = slot * self.slot_bytes
        self._pool.scatter(self._buf[start:start + self.slot_bytes], dst_pages)


class StagingSlots:
    """Prefill side, per decode peer: which of the peer's slots are free, and the local gather buffer."""

    def __init__(self, remote_base: int, slot_bytes: int, num_slots: int, source: PageViews,
                 start_write: Callable[[list[Entry]], Callable[[], None]]) -> None:
        """start_write: the peer's Mooncake writer's; it begins a write and returns a function that waits for it."""
        self.remote_base, self.slot_bytes = remote_base, slot_bytes
        self.pages_per_slot = slot_bytes // source.bytes_per_page
        if self.pages_per_slot < 1 or num_slots < 1:
            raise ConfigError(f"the decode peer's staging slots ({num_slots} x {slot_bytes} bytes) cannot hold "
                              f"one page over all layers ({source.bytes_per_page} bytes)")
        self._source = source
        self._start_write = start_write
        # two gather buffers, so the next slot is gathered while the previous one is on the wire
        self._local = np.zeros(2 * slot_bytes, dtype=np.uint8)
        self._free = set(range(num_slots))
        self._announced: set[int] = set()
        self._retired = 0  # slots a failed write may still land in: never used again
        self._num_slots = num_slots
        self._cond = threading.Condition()
        self.closed = False

    @property
    def local_region(self) -> tuple[int, int]:
        return int(self._local.ctypes.data), self._local.nbytes

    @property
    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)

    def worth_it(self, mean_entry_bytes: float) -> bool:
        """Stage when direct writes would be small entries and some slot is still in service."""
        return mean_entry_bytes < STAGE_BELOW_ENTRY_BYTES and self._retired < self._num_slots

    def acquire(self, timeout: float, stop: Callable[[], bool]) -> int | None:
        """A free slot, or None when `stop()` turns true, the peer closes, or `timeout` passes."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.closed or stop():
                    return None
                if self._free:
                    return self._free.pop()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(min(0.05, remaining))

    def announce(self, slot: int) -> None:
        """The slot's write completed and the decode side is about to hear of it: only now may it free it."""
        with self._cond:
            self._announced.add(slot)

    def release(self, slot: int) -> None:
        """The decode side copied the slot out (StagingDone); PageIndexError for a slot it never heard of."""
        with self._cond:
            if slot not in self._announced:
                raise PageIndexError(f"staging slot {slot} is not waiting to be copied out")
            self._announced.discard(slot)
            self._free.add(slot)
            self._cond.notify()

    def give_back(self, slot: int, *, written: bool) -> None:
        """A slot the decode side never heard of: back into service if nothing was sent into it, retired for
        good if a write was attempted (a late Mooncake write could still land there)."""
        with self._cond:
            if written:
                self._retired += 1
            else:
                self._free.add(slot)
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def gather(self, src_pages: Sequence[int], buffer: int) -> tuple[int, int]:
        """Copy `src_pages` into local gather buffer 0 or 1; returns (address, bytes). Writer thread only."""
        out = self._local[buffer * self.slot_bytes:(buffer + 1) * self.slot_bytes]
        n = self._source.gather(src_pages, out)
        return int(out.ctypes.data), n

    def start_write(self, slot: int, address: int, nbytes: int) -> Callable[[], None]:
        """Begin writing a gathered block into the peer's slot; returns the function that waits for it."""
        return self._start_write([(address, self.remote_base + slot * self.slot_bytes, nbytes)])
