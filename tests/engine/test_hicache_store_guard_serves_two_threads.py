"""The store guard (engine/mem/store_guard.py) serves the engine thread's lookups and the loader thread's reads
at once: every answer is right and the store stays up; and when a read hangs past its deadline while a lookup
waits behind it, both give up at their deadlines, the store is skipped (no third call queues behind the stuck
ones) and it is used again once it answers and the retry window has passed."""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.mem.storage import FileStore, StoreError
from engine.mem.store_guard import GuardedStore, StoreUnavailable


class GatedStore(FileStore):
    """A file store whose reads wait for ``gate`` while ``frozen`` is set."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate, self.frozen = threading.Event(), False

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if self.frozen:
            assert self.gate.wait(30)
        return super().get(keys)


def guarded(tmp_path: Path, timeout: float = 5.0, retry_after: float = 5.0) -> tuple[GuardedStore, GatedStore]:
    inner = GatedStore(tmp_path)
    store = GuardedStore("file", lambda: inner, timeout, retry_after=retry_after)
    assert store.wait_connected(5)
    return store, inner


def test_lookups_and_reads_from_two_threads_all_answer(tmp_path: Path) -> None:
    store, _ = guarded(tmp_path)
    keys = [f"{i:040x}" for i in range(32)]
    store.put([(k, k.encode()) for k in keys[:20]])
    errors: list[BaseException] = []

    def loader() -> None:
        try:
            for i in range(200):
                got = store.get(keys[i % 16:i % 16 + 4])
                assert got == [k.encode() for k in keys[i % 16:i % 16 + 4]]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=loader)
    t.start()
    for i in range(200):
        assert store.exists([keys[i % 32]]) == [i % 32 < 20]
    t.join(30)
    assert not errors and store.state == "up" and store.timeouts == 0
    store.close()


def test_a_hung_read_and_the_lookup_behind_it_give_up_and_the_store_comes_back(tmp_path: Path) -> None:
    store, inner = guarded(tmp_path, timeout=0.3, retry_after=0.5)
    store.put([("a" * 40, b"x")])
    inner.frozen = True
    failed: list[BaseException] = []
    reader = threading.Thread(target=lambda: failed.extend(_raises(lambda: store.get(["a" * 40]))))
    reader.start()
    time.sleep(0.05)  # the read is on the guard's thread, stuck
    start = time.monotonic()
    with pytest.raises(StoreError, match="lookup timed out"):
        store.exists(["a" * 40])  # queued behind the read: waits its own deadline, no longer
    assert time.monotonic() - start < 2.0
    reader.join(5)
    assert len(failed) == 1 and "read timed out" in str(failed[0]) and store.timeouts == 2
    with pytest.raises(StoreUnavailable):
        store.exists(["a" * 40])  # skipped: nothing queues behind the stuck calls
    inner.frozen = False
    inner.gate.set()
    deadline = time.monotonic() + 10
    while True:  # once the stuck calls are done and the window has passed, it answers again
        try:
            assert store.exists(["a" * 40]) == [True]
            break
        except StoreUnavailable:
            assert time.monotonic() < deadline, "the store never came back"
            time.sleep(0.05)
    assert store.state == "up" and store.get(["a" * 40]) == [b"x"]
    store.close()


def _raises(fn) -> list[BaseException]:  # noqa: ANN001 - a call expected to fail
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - returned to the caller's list
        return [e]
    return []
