"""Store writes run behind the engine (engine/mem/store_writer.py): what is stored is the page as it was when
the write was queued, even if the pool page is reused at once; a slow store does not grow the queue past its
bound (the rest is dropped, counted and never copied) and does not hold the caller; the queued writes land once
it answers; one write larger than the bound still goes through an empty queue. A write that fails is reported
and the tree writes the prefix again, once, the next time it is inserted."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.mem.allocator import PageAllocator
from engine.mem.hicache import HostTier
from engine.mem.host_pool import HostPool
from engine.mem.kv_pool import KVPool, KVShape
from engine.mem.hiradix_cache import HiRadixCache
from engine.mem.storage import FileStore, unseal
from engine.mem.store_writer import StoreWriter

SHAPE = KVShape(num_layers=2, num_pages=9, page_size=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
PAGE_BYTES = 2 * 2 * 2 * 1 * 4 * 4  # layers x (K, V) x tokens x heads x dim x 4 bytes


class SlowStore(FileStore):
    """A file store whose lookups wait for ``gate`` (a store that takes its time)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        assert self.gate.wait(30)
        return super().exists(keys)


def tier(store: FileStore) -> HostTier:
    kv = KVPool(SHAPE, torch.device("cpu"))
    return HostTier(HostPool(SHAPE, 8, torch.device("cpu")), kv, PageAllocator(9), store=store, namespace=b"t")


def test_the_stored_page_is_the_one_queued_even_if_the_pool_page_changes(tmp_path: Path) -> None:
    store = SlowStore(tmp_path)
    t = tier(store)
    t.kv.data[:, :, 2:4] = 7.0  # page 1
    assert t.write_store(None, (5, 6), [1])
    t.kv.data[:, :, 2:4] = -1.0  # the pool page is reused before the writer ran
    store.gate.set()
    assert t.writer is not None and t.writer.drain()
    entry = store.get(t._keys(None, (5, 6)))[0]
    data = unseal(entry, PAGE_BYTES)
    assert data is not None and torch.all(torch.frombuffer(bytearray(data), dtype=torch.float32) == 7.0)
    assert t.counters()["stored_tokens"] == 2


def test_a_slow_store_drops_writes_past_the_bound_and_takes_the_rest_later(tmp_path: Path) -> None:
    store = SlowStore(tmp_path)
    writer = StoreWriter(store, page_tokens=2, max_queued_bytes=3 * PAGE_BYTES)
    copied = []

    def snapshot(i: int) -> list[torch.Tensor]:
        copied.append(i)
        return [torch.full((2, 2, 2, 1, 4), float(i))]
    accepted = [writer.submit([f"{i:040x}"], PAGE_BYTES, lambda i=i: snapshot(i), frozenset()) for i in range(5)]
    assert [bool(j) for j in accepted] == [True, True, True, False, False] and writer.dropped == 2  # no waiting
    assert copied == [0, 1, 2]  # a dropped write is not even copied
    assert not writer.drain(0.05)  # the store has not answered yet
    store.gate.set()
    assert writer.drain() and writer.stored_tokens == 6 and writer.failures == 0
    assert all(store.exists([f"{i:040x}" for i in range(3)]))
    big = [torch.zeros(2, 2, 2, 1, 4) for _ in range(5)]  # over the bound, into an empty queue: taken
    assert writer.submit([f"{i:040x}" for i in range(10, 15)], 5 * PAGE_BYTES, lambda: big, frozenset())
    assert writer.drain() and writer.stored_tokens == 16 and writer.close()


class FlakyStore(FileStore):
    """A file store whose first put fails with a client library's own error (not a StoreError)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail = 1
        self.puts = 0

    def put(self, items: Sequence[tuple[str, bytes]], overwrite: bool = False) -> None:
        self.puts += 1
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the client library failed")
        super().put(items, overwrite)


def test_a_write_that_raises_costs_that_write_only(tmp_path: Path) -> None:
    store = FlakyStore(tmp_path)
    writer = StoreWriter(store, page_tokens=2)
    jobs = []
    for i in range(2):
        jobs.append(writer.submit([f"{i:040x}"], PAGE_BYTES, lambda: [torch.ones(2, 2, 2, 1, 4)], frozenset()))
        assert writer.drain()
    assert writer.failures == 1 and writer.stored_tokens == 2 and store.exists([f"{1:040x}"]) == [True]
    assert writer.failed(jobs[0]) and not writer.failed(jobs[1])
    assert writer.close()


def test_a_failed_write_is_retried_once_when_the_prefix_is_inserted_again(tmp_path: Path) -> None:
    key = (1, 2, 3, 4)
    for failures, stored in ((1, True), (5, False)):
        store = FlakyStore(tmp_path / str(failures))
        store.fail = failures
        t = tier(store)
        cache = HiRadixCache(2, t.device.free, "lru", t)
        keys = t._keys(None, key)
        for attempt in range(3):  # the first write fails; the next insert retries it; later ones do not
            cache.insert(key, t.device.alloc(2))
            assert t.writer is not None and t.writer.drain()
        assert store.exists(keys) == [stored, stored] and store.puts == 2, (failures, store.puts)
        assert t.writer.failures == (1 if stored else 2)
        cache.check_invariants()
