"""A store lookup's answer is reused for LOOKUP_TTL_S (a request queued behind others is matched every step, and
each match would otherwise cost the store a round trip), but never past a write of this worker's landing or a
read that found an entry gone: then the store is asked again at once. Another worker's writes are seen within
the TTL."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from engine.mem.allocator import PageAllocator
from engine.mem.hicache import LOOKUP_TTL_S, HostTier
from engine.mem.host_pool import HostPool
from engine.mem.kv_pool import KVPool, KVShape
from engine.mem.storage import FileStore, seal

SHAPE = KVShape(num_layers=2, num_pages=9, page_size=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
PAGE_BYTES = 2 * 2 * 2 * 1 * 4 * 4
TOKENS = (5, 6, 7, 8, 9, 10)  # three pages


class CountingStore(FileStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.lookups = 0

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self.lookups += 1
        return super().exists(keys)


def test_lookups_are_reused_until_the_ttl_or_a_write_or_a_miss(tmp_path: Path) -> None:
    store, now = CountingStore(tmp_path), [100.0]
    tier = HostTier(HostPool(SHAPE, 8, torch.device("cpu")), KVPool(SHAPE, torch.device("cpu")), PageAllocator(9),
                    store=store, namespace=b"t", clock=lambda: now[0])
    assert tier.stored_run(None, TOKENS, 0) == [] and store.lookups == 1
    for _ in range(5):  # five steps of a queued request: one round trip
        assert tier.stored_run(None, TOKENS, 0) == []
    assert store.lookups == 1
    keys = tier._keys(None, TOKENS)
    store.put([(k, seal(bytes(PAGE_BYTES))) for k in keys[:2]])  # another worker stores two pages
    assert tier.stored_run(None, TOKENS, 0) == [] and store.lookups == 1  # not seen yet, within the TTL
    now[0] += LOOKUP_TTL_S
    assert tier.stored_run(None, TOKENS, 0) == keys[:2] and store.lookups == 2  # seen once the TTL is over
    assert tier.stored_run(None, TOKENS, 1) == keys[1:2] and store.lookups == 3  # another run is its own lookup
    # this worker's own write landing is seen at once
    assert tier.write_store(None, TOKENS, [1, 2, 3]) and tier.writer is not None and tier.writer.drain()
    before = store.lookups  # the writer looks up what the store lacks, too
    assert tier.stored_run(None, TOKENS, 0) == keys and store.lookups == before + 1
    assert tier.stored_run(None, TOKENS, 0) == keys and store.lookups == before + 1
    # an entry found gone when read: the next match asks the store again
    store.delete(keys[1:2])
    read = tier.copy_in((), keys, [4, 5, 6])  # as a load-back reads them, then accounts them
    tier.finish_load(read, 0)
    assert read.stored == 1 and tier.stats.store_misses == 1
    assert tier.stored_run(None, TOKENS, 0) == keys[:1] and store.lookups == before + 2
    tier.close()
