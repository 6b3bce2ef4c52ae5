"""Writes to HiCache's shared store behind the engine: the engine thread only copies the pages out of the pool
(they may hold other KV a step later); sealing (a checksum over every byte), the lookup of what the store
already holds, and the writes run on this writer's own thread. A write is dropped, and counted, when more than
``max_queued_bytes`` are already waiting (a slow or stuck store must not grow the queue without bound; a write
into an empty queue is always taken, however large) or when the store is not up, in both cases before the
engine copies anything; a dropped or failed write only costs a later miss. A failed write is reported
(``failed``) so the tree can retry it once, the next time the prefix is inserted. The counters are this
object's, written by its thread alone (``dropped`` by the engine thread alone)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from engine.mem.storage import PageStore, StoreError, seal

log = logging.getLogger(__name__)
BATCH = 16  # most pages per store call (fewer where the store's max_batch_bytes says so)
FAILED_KEPT = 4096  # failed writes remembered for a retry


def batches(items: Sequence, entry_bytes: int, max_batch_bytes: int) -> list[Sequence]:
    """``items`` cut into store calls of at most BATCH entries and ``max_batch_bytes`` (at least one entry)."""
    per = max(1, min(BATCH, max_batch_bytes // max(1, entry_bytes)))
    return [items[i:i + per] for i in range(0, len(items), per)]


class StoreWriter:
    def __init__(self, store: PageStore, page_tokens: int, max_queued_bytes: int = 256 << 20) -> None:
        self.store = store
        self.page_tokens = page_tokens
        self.max_queued_bytes = max_queued_bytes
        self.stored_tokens = 0  # tokens written (writer thread)
        self.failures = 0  # writes the store refused or failed (writer thread)
        self.dropped = 0  # writes never queued: queue full or store not up (engine thread)
        self._queue: queue.SimpleQueue[tuple[int, list[str], list[torch.Tensor], frozenset[str], int] | None] = (
            queue.SimpleQueue())
        self._jobs = 0  # ids handed out (engine thread)
        self._retries: set[int] = set()  # jobs that are themselves retries: not retried again
        self._failed: OrderedDict[int, None] = OrderedDict()  # failed jobs worth one retry (newest FAILED_KEPT)
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self._outstanding = 0  # jobs queued or being written
        self._thread: threading.Thread | None = None

    def submit(self, keys: Sequence[str], size: int, snapshot: Callable[[], list[torch.Tensor]],
               overwrite: frozenset[str], retry: bool = False) -> int:
        """Queue the pages ``snapshot()`` copies (``size`` bytes; called only if the write is taken) to be stored
        under ``keys``; those in ``overwrite`` replace what is there. Returns the write's id (``failed`` tells
        whether it failed; a ``retry`` that fails is not reported), 0 if dropped."""
        with self._lock:
            behind = self._queued_bytes
            if self.store.direct() is None or (behind and behind + size > self.max_queued_bytes):
                self.dropped += 1
                if behind:
                    log.warning("hicache store writes are %d MB behind: dropping a write of %d pages",
                                behind >> 20, len(keys))
                return 0
            self._queued_bytes += size
            self._outstanding += 1
            self._jobs += 1
            job = self._jobs
            if retry:
                self._retries.add(job)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hicache-store-writer", daemon=True)
            self._thread.start()
        self._queue.put((job, list(keys), snapshot(), overwrite, size))
        return job

    def failed(self, job: int) -> bool:
        """Did write ``job`` fail (and was it not itself a retry)? Forgotten after FAILED_KEPT newer failures."""
        with self._lock:
            return job in self._failed

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write is done (tests, shutdown); False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while self._outstanding:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout: float = 2.0) -> bool:
        """Let queued writes finish for up to ``timeout``, then stop; False if a write is still running (its
        store must not be closed under it)."""
        self.drain(timeout)
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(max(0.1, timeout / 4))
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            job, keys, pages, overwrite, size = item
            ok = False
            try:
                self._write(keys, pages, overwrite)
                ok = True
            except Exception as e:  # noqa: BLE001 - any failure (the client library's own too) costs this write only
                self.failures += 1
                log.warning("hicache store write failed, going on without it: %s: %s", type(e).__name__, e)
            finally:
                with self._lock:
                    self._queued_bytes -= size
                    self._outstanding -= 1
                    if not ok and job not in self._retries:
                        self._failed[job] = None
                        if len(self._failed) > FAILED_KEPT:
                            self._failed.popitem(last=False)
                    self._retries.discard(job)

    def _write(self, keys: list[str], pages: list[torch.Tensor], overwrite: frozenset[str]) -> None:
        store = self.store.direct()
        if store is None:
            raise StoreError("the store went down before the write")
        present = store.exists(keys)
        # content-addressed: an entry there already is this one, unless it was found bad (then replace it)
        todo = [(k, p) for k, p, there in zip(keys, pages, present) if not there or k in overwrite]
        entry = pages[0].numel() * pages[0].element_size() if pages else 0
        for batch in batches(todo, entry, store.max_batch_bytes):
            store.put([(k, seal(p.view(torch.uint8).numpy().tobytes())) for k, p in batch],
                      overwrite=any(k in overwrite for k, _ in batch))
            self.stored_tokens += len(batch) * self.page_tokens
