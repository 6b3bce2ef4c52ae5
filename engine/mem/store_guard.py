"""A deadline on every store operation, so a store that hangs costs the engine at most that long.

The engine thread calls the store between steps; a frozen store (a stopped ``mooncake_master``, a hung network
file system) would otherwise stall every request on the worker. ``GuardedStore`` runs each operation on its own
thread and waits at most ``timeout`` seconds (``--hicache-storage-timeout``). Past the deadline, or when the
store reports itself unreachable, it turns *down*: for ``retry_after`` seconds nothing is asked of it (lookups
are misses, writes are dropped, at no cost), then the next operation tries again. While an operation that
missed its deadline is still stuck on the thread, later ones are not queued behind it: they are skipped. The
first connection is made the same way, in the background, so a worker starts (and serves, recomputing) while
its store is unreachable, and uses the store once it answers.

Two threads call it (the engine thread looks entries up, the HiCache loader thread reads and deletes them):
their operations share the one worker thread, in the order they come, and a lock keeps its state (connecting,
up, down; the operation stuck past its deadline) consistent between them. A caller waits behind the other's
operation at most one batch, or its own deadline if the store hangs.

Measured with a real ``mooncake_master`` on loopback: frozen by SIGSTOP, each client call blocks 30 s (the RPC
timeout); killed, a lookup takes 4.3 s to fail; a client set up against no master blocks 90 s. Behind the guard,
the engine waits at most ``timeout`` once per ``retry_after``."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before Python 3.11
from typing import TypeVar

from engine.mem.storage import PageStore, StoreError, StoreUnreachable

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoreUnavailable(StoreError):
    """Not attempted: the store is connecting, down since a failure, or busy with an operation past its
    deadline. Nothing was asked of it, so nothing is counted as failed."""


class GuardedStore(PageStore):
    def __init__(self, name: str, connect: Callable[[], PageStore], timeout: float,
                 retry_after: float = 5.0, max_batch_bytes: int = PageStore.max_batch_bytes) -> None:
        self.name = name
        self.max_batch_bytes = max_batch_bytes
        self.timeout = timeout
        self.retry_after = retry_after
        self.timeouts = 0  # operations abandoned at their deadline
        self.state = "connecting"
        self.connect_error: Exception | None = None  # why the last connection attempt failed
        self._connect = connect
        self._inner: PageStore | None = None
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future] | None] = queue.SimpleQueue()
        self._pending: Future | None = None  # the job on the thread, if it outlived its caller's deadline
        self._pending_seq = 0
        self._seq = 0  # jobs submitted (the worker runs them in this order)
        self._lock = threading.Lock()  # state, _inner, _pending, _retry_at: callers on two threads
        self._retry_at = 0.0
        self._thread = threading.Thread(target=self._work, name=f"hicache-{name}-store", daemon=True)
        self._thread.start()
        self._pending, self._pending_seq = self._submit(connect)

    def wait_connected(self, timeout: float) -> bool:
        """Block up to ``timeout`` for the first connection (start-up); False if it has not come up by then."""
        fut = self._pending
        if fut is not None:
            try:
                fut.result(timeout)
            except Exception:  # noqa: BLE001 - a timeout or a failed connection: _ready() sorts out which
                pass
        try:
            self._ready()
        except StoreError:
            return False
        return True

    # -- PageStore ---------------------------------------------------------------------------------------------
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._call("read", lambda s: s.get(keys))

    def put(self, items: Sequence[tuple[str, bytes]], overwrite: bool = False) -> None:
        self._call("write", lambda s: s.put(items, overwrite))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._call("lookup", lambda s: s.exists(keys))

    def delete(self, keys: Sequence[str]) -> None:
        self._call("delete", lambda s: s.delete(keys))

    def direct(self) -> PageStore | None:
        return self._inner if self.state == "up" else None  # read from the writer's thread: a stale "up" costs
        # one failed write at most

    def close(self) -> None:
        """Stop the thread and close the store, waiting at most ``timeout`` (a dead store's client may take
        seconds to give up)."""
        inner, self._inner, self.state = self._inner, None, "down"
        if inner is not None:
            self._jobs.put((inner.close, Future()))
        self._jobs.put(None)
        self._thread.join(self.timeout)

    # -- the guard ---------------------------------------------------------------------------------------------
    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller, who owns the error
                    fut.set_exception(e)

    def _submit(self, fn: Callable[[], T]) -> tuple[Future, int]:
        fut: Future = Future()
        with self._lock:
            self._seq += 1
            self._jobs.put((fn, fut))
            return fut, self._seq

    def _ready(self) -> PageStore:
        """The store, if it may be asked now; else StoreUnavailable (and a reconnection started when due)."""
        with self._lock:
            return self._ready_locked()

    def _ready_locked(self) -> PageStore:
        fut = self._pending
        if fut is not None:
            if not fut.done():
                raise StoreUnavailable(f"{self.name} store is {self.state}: an operation is still running "
                                       f"past its {self.timeout}s deadline")
            self._pending = None
            if self._inner is None:  # that was a connection attempt
                try:
                    self._inner, self.connect_error = fut.result(), None
                    self._set("up", "connected")
                except Exception as e:  # noqa: BLE001 - any failure to connect leaves the store down, not the engine
                    self.connect_error = e
                    self._set("down", f"cannot connect: {e}")
        now = time.monotonic()
        if self.state == "down" and now < self._retry_at:
            raise StoreUnavailable(f"{self.name} store is down; next try in {self._retry_at - now:.1f}s")
        if self._inner is None:
            self._seq += 1
            self._pending, self._pending_seq = Future(), self._seq
            self._jobs.put((self._connect, self._pending))
            self.state = "connecting"
            raise StoreUnavailable(f"{self.name} store is connecting")
        return self._inner

    def _call(self, op: str, fn: Callable[[PageStore], T]) -> T:
        inner = self._ready()
        fut, seq = self._submit(lambda: fn(inner))
        try:
            result = fut.result(self.timeout)
        except (TimeoutError, FutureTimeout):
            with self._lock:
                self.timeouts += 1
                if self._pending is None or seq > self._pending_seq:  # the newest stuck job: once it is done,
                    self._pending, self._pending_seq = fut, seq  # every job before it is too
                self._set("down", f"{op} took longer than {self.timeout}s")
            raise StoreError(f"{op} timed out after {self.timeout}s") from None
        except StoreUnreachable as e:
            self._set_locked("down", str(e))
            raise
        except StoreError:
            self._set_locked("up", "answering again")
            raise
        except Exception as e:  # noqa: BLE001 - a client library's own error is the store's failure, not ours
            raise StoreError(f"{op}: {type(e).__name__}: {e}") from e
        self._set_locked("up", "answering again")
        return result

    def _set_locked(self, state: str, why: str) -> None:
        with self._lock:
            self._set(state, why)

    def _set(self, state: str, why: str) -> None:
        if state == "down":
            self._retry_at = time.monotonic() + self.retry_after
        if state != self.state:
            level = logging.WARNING if state == "down" else logging.INFO
            log.log(level, "hicache %s store %s: %s%s", self.name, state, why,
                    f" (skipped for {self.retry_after}s)" if state == "down" else "")
        self.state = state
