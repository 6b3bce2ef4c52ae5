"""Seeded random streams of match/insert/lock/unlock/evict against a simple reference model of the radix cache.

The reference keeps one entry per cached page-prefix: (namespace, tokens up to the end of page k) -> page id.
After every step the tree's invariants, its sizes and its pages are compared with the reference."""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.mem.radix_cache import RadixCache

PAGE = 2
NAMESPACES = [None, "tenant-a"]
# Small alphabet and a few shared stems, so prefixes collide and nodes split often.
STEMS = [(1, 2, 3, 4), (1, 2, 5, 6), (7, 8), ()]
tokens = st.lists(st.integers(min_value=1, max_value=3), min_size=0, max_size=8)


class RadixAgainstReference(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.freed: list[int] = []
        self.cache = RadixCache(PAGE, self.freed.extend, policy="lru")
        self.ref: dict[tuple[str | None, tuple[int, ...]], int] = {}
        self.locks: list[tuple[object, str | None, tuple[int, ...]]] = []
        self.next_page = 1

    def _key(self, stem: int, tail: list[int]) -> tuple[int, ...]:
        return STEMS[stem] + tuple(tail)

    def _ref_match(self, ns: str | None, key: tuple[int, ...]) -> list[int]:
        pages = []
        for end in range(PAGE, len(key) - len(key) % PAGE + 1, PAGE):
            page = self.ref.get((ns, key[:end]))
            if page is None:
                break
            pages.append(page)
        return pages

    @rule(ns=st.sampled_from(NAMESPACES), stem=st.integers(0, len(STEMS) - 1), tail=tokens)
    def insert(self, ns: str | None, stem: int, tail: list[int]) -> None:
        key = self._key(stem, tail)
        key = key[: len(key) - len(key) % PAGE]
        pages = list(range(self.next_page, self.next_page + len(key) // PAGE))
        self.next_page += len(pages)
        expected_dup = len(self._ref_match(ns, key)) * PAGE
        dup = self.cache.insert(key, pages, extra_key=ns)
        assert dup == expected_dup
        for k in range(dup // PAGE, len(pages)):
            self.ref[(ns, key[: (k + 1) * PAGE])] = pages[k]

    @rule(ns=st.sampled_from(NAMESPACES), stem=st.integers(0, len(STEMS) - 1), tail=tokens, lock=st.booleans())
    def match(self, ns: str | None, stem: int, tail: list[int], lock: bool) -> None:
        key = self._key(stem, tail)
        peeked = self.cache.cached_length(key, ns)
        result = self.cache.match_prefix(key, extra_key=ns)
        assert result.pages == self._ref_match(ns, key) and peeked == result.num_tokens
        if lock and result.pages:
            self.cache.inc_lock(result.node)
            self.locks.append((result.node, ns, key[: result.num_tokens]))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(min_value=0))
    def unlock(self, i: int) -> None:
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock(node)

    @rule(n=st.integers(min_value=0, max_value=12))
    def evict(self, n: int) -> None:
        evictable_before = self.cache.evictable_size
        self.freed.clear()
        freed_tokens = self.cache.evict(n)
        assert freed_tokens == len(self.freed) * PAGE
        assert freed_tokens >= min(n, evictable_before)
        by_page = {page: k for k, page in self.ref.items()}
        for page in self.freed:
            ns, prefix = by_page[page]
            assert not self._locked(ns, prefix), f"evicted locked prefix {prefix}"
            del self.ref[(ns, prefix)]
        for ns, prefix in self.ref:  # still prefix-closed: a page is only evicted after all its extensions
            assert len(prefix) == PAGE or (ns, prefix[:-PAGE]) in self.ref

    def _locked(self, ns: str | None, prefix: tuple[int, ...]) -> bool:
        return any(lns == ns and lp[: len(prefix)] == prefix and len(lp) >= len(prefix)
                   for _, lns, lp in self.locks)

    @invariant()
    def agrees_with_reference(self) -> None:
        self.cache.check_invariants()
        assert sorted(self.cache.owned_pages()) == sorted(self.ref.values())
        protected = sum(PAGE for ns, prefix in self.ref if self._locked(ns, prefix))
        assert self.cache.protected_size == protected
        assert self.cache.evictable_size == len(self.ref) * PAGE - protected


TestRadixAgainstReference = RadixAgainstReference.TestCase
TestRadixAgainstReference.settings = settings(
    max_examples=300, stateful_step_count=40, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
