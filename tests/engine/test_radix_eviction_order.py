"""Eviction order per policy, namespaces that never share, page-aligned matching and splits that re-slice pages."""
from __future__ import annotations

from engine.mem.radix_cache import RadixCache

P = 2


def cache(policy: str) -> tuple[RadixCache, list[int]]:
    freed: list[int] = []
    return RadixCache(P, freed.extend, policy), freed


def test_lru_evicts_least_recently_used_leaf_first() -> None:
    c, freed = cache("lru")
    c.insert((1, 1, 2, 2), [10, 11])
    c.insert((3, 3, 4, 4), [20, 21])
    c.match_prefix((1, 1, 2, 2))  # touch the first: the second is now older
    assert c.evict(2) == 4 and sorted(freed) == [20, 21]


def test_lfu_evicts_least_hit_leaf_first() -> None:
    c, freed = cache("lfu")
    c.insert((1, 1), [10])
    c.insert((3, 3), [20])
    for _ in range(3):
        c.match_prefix((3, 3))
    c.match_prefix((1, 1))  # most recent, but fewer hits
    c.evict(2)
    assert freed == [10]


def test_priority_evicts_lowest_priority_first() -> None:
    c, freed = cache("priority")
    c.insert((1, 1), [10], priority=5)
    c.insert((3, 3), [20], priority=1)
    c.match_prefix((3, 3))
    c.evict(2)
    assert freed == [20]


def test_locked_prefix_is_never_evicted_and_counts_as_protected() -> None:
    c, freed = cache("lru")
    c.insert((1, 1, 2, 2, 3, 3), [10, 11, 12])
    m = c.match_prefix((1, 1, 2, 2))
    assert m.pages == [10, 11]
    c.inc_lock(m.node)
    assert (c.protected_size, c.evictable_size) == (4, 2)
    assert c.evict(100) == 2 and freed == [12]
    c.dec_lock(m.node)
    assert c.evict(100) == 4 and sorted(freed) == [10, 11, 12]


def test_namespaces_never_share_pages() -> None:
    c, _ = cache("lru")
    c.insert((1, 1, 2, 2), [10, 11], extra_key="a")
    assert c.match_prefix((1, 1, 2, 2), extra_key="b").pages == []
    assert c.match_prefix((1, 1, 2, 2)).pages == []
    assert c.insert((1, 1, 2, 2), [30, 31], extra_key="b") == 0  # nothing was cached in b
    assert c.match_prefix((1, 1, 2, 2), extra_key="a").pages == [10, 11]


def test_match_is_page_aligned_and_split_reslices_pages() -> None:
    c, _ = cache("lru")
    c.insert((1, 1, 2, 2, 3, 3), [10, 11, 12])
    assert c.match_prefix((1, 1, 2, 9)).pages == [10]  # a partial page never matches
    assert c.match_prefix((1, 1, 2)).pages == [10]
    c.check_invariants()
    # the split left two nodes whose pages are slices of the original list, no new pages
    assert sorted(c.owned_pages()) == [10, 11, 12]
    assert c.insert((1, 1, 5, 5), [40, 41]) == 2
    assert sorted(c.owned_pages()) == [10, 11, 12, 41]
