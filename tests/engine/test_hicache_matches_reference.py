"""HiCache's tree over a real device pool and host pool, driven by seeded random streams of insert / match /
load-back (waited for, or started on the loader thread and finished some steps later) / lock / unlock /
evict, checked after every step:

- structure, counters and both allocators agree (each page free or owned once, in the tier the tree says);
- every page the tree names, in either tier, holds the KV written for exactly that prefix (the pages carry a
  value derived from (namespace, tokens through the page), so a copy to the wrong page or a stale page fails);
- a locked match keeps its L1 pages (never demoted or freed);
- a load in flight owns its pages (counted by the integrity check) and a match that reaches it is pending;
- with a host tier large enough for everything, nothing is ever lost: every inserted prefix is still matched
  in full (L1 + L2), whatever L1 evicted; with a small one, what is matched is still right."""
from __future__ import annotations

import math
import shutil
import tempfile
import zlib
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.mem.allocator import PageAllocator
from engine.mem.base import MatchResult
from engine.mem.hicache import HostTier
from engine.mem.host_pool import HostPool
from engine.mem.kv_pool import KVPool, KVShape
from engine.mem.hiradix_cache import HiRadixCache
from engine.mem.storage import FileStore

PAGE = 2
DEVICE_PAGES = 7  # 6 usable: inserts of up to 4 pages force evictions all the time
NAMESPACES = [None, "tenant-a"]
STEMS = [(1, 2, 3, 4), (1, 2, 5, 6), (7, 8), ()]
tokens = st.lists(st.integers(min_value=1, max_value=3), min_size=0, max_size=8)


def value(ns: str | None, prefix: tuple[int, ...]) -> float:
    return float(zlib.crc32(repr((ns, prefix)).encode()) % 1_000_003)


class HiCacheAgainstReference(RuleBasedStateMachine):
    policy = "write_back"
    host_pages = 200
    with_store = False

    def __init__(self) -> None:
        super().__init__()
        self.store_dir = Path(tempfile.mkdtemp(prefix="hicache-ref-")) if self.with_store else None
        shape = KVShape(num_layers=2, num_pages=DEVICE_PAGES, page_size=PAGE, num_kv_heads=1, head_dim=2,
                        dtype=torch.float32)
        self.kv = KVPool(shape, torch.device("cpu"))
        self.device = PageAllocator(DEVICE_PAGES)
        self.host = HostPool(shape, self.host_pages, torch.device("cpu"))
        store = FileStore(self.store_dir) if self.store_dir else None
        self.tier = HostTier(self.host, self.kv, self.device, self.policy, write_threshold=2, store=store,
                             namespace=b"reference", overlap=True)  # loads from L2 may run in the background
        self.cache = HiRadixCache(PAGE, self.device.free, "lru", self.tier)
        self.inserted: set[tuple[str | None, tuple[int, ...]]] = set()
        self.locks: list[tuple[MatchResult, str | None, tuple[int, ...]]] = []

    def _key(self, stem: int, tail: list[int]) -> tuple[int, ...]:
        key = STEMS[stem] + tuple(tail)
        return key[: len(key) - len(key) % PAGE]

    def _fill(self, pages: list[int], ns: str | None, key: tuple[int, ...]) -> None:
        for k, page in enumerate(pages):
            self.kv.data[:, :, page * PAGE:(page + 1) * PAGE] = value(ns, key[: (k + 1) * PAGE])

    def _expected(self, ns: str | None, key: tuple[int, ...]) -> int:
        n = 0
        while n + PAGE <= len(key) and (ns, key[: n + PAGE]) in self.inserted:
            n += PAGE
        return n

    @rule(ns=st.sampled_from(NAMESPACES), stem=st.integers(0, len(STEMS) - 1), tail=tokens)
    def insert(self, ns: str | None, stem: int, tail: list[int]) -> None:
        key = self._key(stem, tail)
        need = len(key) // PAGE
        if self.device.available < need:
            self.cache.evict((need - self.device.available) * PAGE)
        pages = self.device.alloc(need)
        if pages is None:
            return  # everything is locked: the caller would wait
        self._fill(pages, ns, key)
        before = self.cache.match_prefix(key, ns).num_tokens
        held = self.cache.insert(key, pages, extra_key=ns)
        assert held == before, "insert reports the L1-held prefix it did not take pages for"
        self.device.free(pages[: held // PAGE])
        self.inserted.update((ns, key[: (k + 1) * PAGE]) for k in range(need))

    @rule(ns=st.sampled_from(NAMESPACES), stem=st.integers(0, len(STEMS) - 1), tail=tokens, load=st.booleans(),
          lock=st.booleans())
    def match(self, ns: str | None, stem: int, tail: list[int], load: bool, lock: bool) -> None:
        key = STEMS[stem] + tuple(tail)
        self._drain()
        if load:
            self.cache.finish_loads(wait=True)  # as the scheduler's synchronous path does when a match is pending
        peeked = self.cache.cached_length(key, ns)
        result = self.cache.match_prefix(key, ns)
        tree_tokens = result.num_tokens + sum(len(n.key) for n in result.host_nodes)
        found = result.num_tokens + result.host_tokens
        if result.pending:  # the match stops where a load in flight is bringing pages in
            assert not result.host_nodes and not result.stored_keys and peeked >= tree_tokens
            assert found <= self._expected(ns, key)
        else:
            assert peeked == tree_tokens, "cached_length disagrees with the match over the tree's tiers"
            if self.host_pages >= 200:
                assert found == self._expected(ns, key), "a prefix was lost"
        if load:
            total = result.num_tokens + result.host_tokens
            result = self.cache.load_back(result)
            assert result.num_tokens <= total and not result.host_nodes
            if self.device.capacity - self.cache.protected_size // PAGE >= total // PAGE:
                assert result.num_tokens == total, "load-back stopped with room left"
        for k, page in enumerate(result.pages):
            got = self.kv.data[:, :, page * PAGE:(page + 1) * PAGE]
            assert torch.all(got == value(ns, key[: (k + 1) * PAGE])), f"L1 page {page} holds another prefix's KV"
        if lock and result.pages:
            self.cache.inc_lock(result.node)
            self.locks.append((result, ns, key[: result.num_tokens]))

    @rule(ns=st.sampled_from(NAMESPACES), stem=st.integers(0, len(STEMS) - 1), tail=tokens, inline=st.booleans())
    def start_load(self, ns: str | None, stem: int, tail: list[int], inline: bool) -> None:
        """A load in the background, or (``inline``, once the tier has timed a copy) made at once."""
        key = STEMS[stem] + tuple(tail)
        self._drain()
        result = self.cache.match_prefix(key, ns)
        before = self.cache.loads_in_flight
        started = self.cache.start_load(result, math.inf if inline else 0.0) is None
        assert self.cache.loads_in_flight == before + started
        if result.pending or not (result.host_nodes or result.stored_keys):
            assert not started, "a load started over nothing, or over another load"
        elif started:
            assert self.cache.match_prefix(key, ns).pending, "a match over a load in flight is not pending"
        elif inline and not result.stored_keys and self.device.available == self.device.capacity:
            assert self.cache.match_prefix(key, ns).num_tokens > result.num_tokens, "nothing loaded in line"

    @precondition(lambda self: self.cache.loads_in_flight)
    @rule()
    def finish_loads(self) -> None:
        n = self.cache.loads_in_flight
        assert self.cache.finish_loads(wait=True) == n and self.cache.loads_in_flight == 0

    def _drain(self) -> None:
        if self.tier.writer is not None:
            assert self.tier.writer.drain()  # store writes run behind: wait, so the model is exact

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(min_value=0))
    def unlock(self, i: int) -> None:
        result, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock(result.node)

    @rule(n=st.integers(min_value=0, max_value=12))
    def evict(self, n: int) -> None:
        evictable = self.cache.evictable_size
        assert self.cache.evict(n) >= min(n, evictable)

    def teardown(self) -> None:
        self.cache.finish_loads(wait=True)
        self.tier.close()
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    @invariant()
    def tiers_hold_the_right_kv(self) -> None:
        self.cache.check_invariants()
        self.device.check_integrity([self.cache.owned_pages()])
        for ns, prefix, pages, host in self.cache.entries():
            first = len(prefix) // PAGE - len(pages or host or ())
            for k, page in enumerate(pages):
                got = self.kv.data[:, :, page * PAGE:(page + 1) * PAGE]
                assert torch.all(got == value(ns, prefix[: (first + k + 1) * PAGE]))
            for k, page in enumerate(host or ()):
                got = self.host.data[:, :, page * PAGE:(page + 1) * PAGE]
                assert torch.all(got == value(ns, prefix[: (first + k + 1) * PAGE])), "L2 page holds wrong KV"
        for result, ns, key in self.locks:
            again = self.cache.match_prefix(key, ns)
            assert again.pages[: len(result.pages)] == result.pages, "a locked prefix left L1"


class WriteThroughRoomy(HiCacheAgainstReference):
    policy = "write_through"


class SelectiveRoomy(HiCacheAgainstReference):
    policy = "write_through_selective"


class WriteBackTight(HiCacheAgainstReference):
    host_pages = 5  # 4 usable: L2 drops entries all the time


class WriteThroughTight(HiCacheAgainstReference):
    policy = "write_through"
    host_pages = 5


class WriteThroughTightWithStore(WriteThroughTight):
    with_store = True  # what L2 drops comes back from the store, into whatever L1 has room for


class WriteBackTightWithStore(WriteBackTight):
    with_store = True


_SETTINGS = settings(max_examples=60, stateful_step_count=40, derandomize=True, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestWriteBackRoomy = HiCacheAgainstReference.TestCase
TestWriteThroughRoomy = WriteThroughRoomy.TestCase
TestSelectiveRoomy = SelectiveRoomy.TestCase
TestWriteBackTight = WriteBackTight.TestCase
TestWriteThroughTight = WriteThroughTight.TestCase
TestWriteThroughTightWithStore = WriteThroughTightWithStore.TestCase
TestWriteBackTightWithStore = WriteBackTightWithStore.TestCase
for _case in (TestWriteBackRoomy, TestWriteThroughRoomy, TestSelectiveRoomy, TestWriteBackTight,
              TestWriteThroughTight, TestWriteThroughTightWithStore, TestWriteBackTightWithStore):
    _case.settings = _SETTINGS


def _tree(policy: str) -> tuple[HiRadixCache, PageAllocator, HostPool]:
    shape = KVShape(num_layers=1, num_pages=DEVICE_PAGES, page_size=PAGE, num_kv_heads=1, head_dim=2,
                    dtype=torch.float32)
    kv, device = KVPool(shape, torch.device("cpu")), PageAllocator(DEVICE_PAGES)
    host = HostPool(shape, 20, torch.device("cpu"))
    return HiRadixCache(PAGE, device.free, "lru", HostTier(host, kv, device, policy, write_threshold=2)), device, host


def test_each_write_policy_copies_to_the_host_tier_when_it_says() -> None:
    key = (1, 2, 3, 4)
    for policy, after_insert, after_second_hit in (("write_through", 2, 2), ("write_back", 0, 0),
                                                  ("write_through_selective", 0, 2)):
        cache, device, host = _tree(policy)
        cache.insert(key, device.alloc(2))
        assert host.allocator.used == after_insert, policy
        cache.insert(key, device.alloc(2))  # a second hit (the caller frees its duplicate pages)
        assert host.allocator.used == after_second_hit, policy
        cache.evict(4)  # evicted from the pool: every policy has it in the host tier now
        assert host.allocator.used == 2 and cache.match_prefix(key).host_tokens == 4, policy


def test_a_store_hit_loads_only_what_the_pool_has_room_for(tmp_path: Path) -> None:
    shape = KVShape(num_layers=1, num_pages=DEVICE_PAGES, page_size=PAGE, num_kv_heads=1, head_dim=2,
                    dtype=torch.float32)
    key = (1, 2, 3, 4, 5, 6, 7, 8)

    def tree() -> tuple[HiRadixCache, PageAllocator, KVPool]:
        kv, device = KVPool(shape, torch.device("cpu")), PageAllocator(DEVICE_PAGES)
        tier = HostTier(HostPool(shape, 20, torch.device("cpu")), kv, device, "write_through",
                        store=FileStore(tmp_path), namespace=b"t")
        return HiRadixCache(PAGE, device.free, "lru", tier), device, kv

    writer, device, kv = tree()
    pages = device.alloc(4)
    for k, page in enumerate(pages):
        kv.data[:, :, page * PAGE:(page + 1) * PAGE] = value(None, key[: (k + 1) * PAGE])
    writer.insert(key, pages)  # write_through: in L2 and in the store
    assert writer.tier is not None and writer.tier.writer is not None and writer.tier.writer.drain()
    for free in (2, 0):
        reader, device, kv = tree()
        held = device.alloc(device.available - free)  # someone else holds the rest of the pool
        match = reader.match_prefix(key + (9,))
        assert match.host_tokens == 8 and match.num_tokens == 0
        loaded = reader.load_back(match)
        assert loaded.num_tokens == free * PAGE
        reader.check_invariants()
        device.check_integrity([reader.owned_pages(), held])
        for k, page in enumerate(loaded.pages):
            assert torch.all(kv.data[:, :, page * PAGE:(page + 1) * PAGE] == value(None, key[: (k + 1) * PAGE]))
