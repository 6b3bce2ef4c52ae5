"""The prefix-cache interface the scheduler uses; RadixCache implements it, NoPrefixCache turns caching off.

Ownership rule: pages returned by ``match_prefix`` belong to the cache; ``insert`` takes ownership of the pages
for tokens the cache did not hold yet and returns how many leading tokens it already held (the caller frees its
own pages in that range, except those it got from ``match_prefix``)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class MatchResult:
    pages: list[int]
    node: Any  # opaque handle for lock/unlock (the match's last L1 node)
    page_size: int
    host_nodes: tuple[Any, ...] = ()  # HiCache: the match continues in lower tiers (``load_back`` copies it in)
    host_tokens: int = 0  # tokens in lower tiers (host nodes, then stored pages)
    stored_keys: tuple[str, ...] = ()  # pages after the tree's match that the shared store (L3) holds
    stored_tokens: tuple[int, ...] = ()  # their token ids
    pending: bool = False  # the match reaches what a load in flight brings into the pool: ask again after it

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV is in the device pool now."""
        return len(self.pages) * self.page_size


class PrefixCache(ABC):
    page_size: int
    enabled: bool

    @abstractmethod
    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``."""

    def cached_length(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Tokens of ``key``'s longest cached prefix, without side effects (for ranking a queue)."""
        return 0

    def load_back(self, match: MatchResult) -> MatchResult:
        """Copy the part of ``match`` that lives in lower tiers into the device pool (as far as it has room);
        returns the longer match. Caches without tiers have nothing to load."""
        return match

    def start_load(self, match: MatchResult, inline_under_s: float = 0.0) -> MatchResult | None:
        """Start that copy in the background (``finish_loads`` completes it; returns None), or make it now if it
        is expected to take under ``inline_under_s`` (returns the longer match)."""
        return match

    def finish_loads(self, wait: bool = False) -> int:
        """Complete the background copies that are done (all of them, with ``wait``); returns how many."""
        return 0

    @property
    def loads_in_flight(self) -> int:
        return 0

    @abstractmethod
    def insert(self, key: Sequence[int], pages: Sequence[int], extra_key: str | None = None,
               priority: int = 0) -> int:
        """Cache ``key`` (a whole number of pages) backed by ``pages``; returns tokens that were already cached."""

    @abstractmethod
    def inc_lock(self, node: Any) -> None:
        """Protect ``node`` and its ancestors from eviction."""

    @abstractmethod
    def dec_lock(self, node: Any) -> None:
        """Undo one ``inc_lock``."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` cached tokens if possible; returns tokens freed."""

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens no request holds (can be evicted)."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens locked by in-flight requests."""

    @abstractmethod
    def owned_pages(self) -> list[int]:
        """Every page the cache owns (for allocator integrity checks)."""

    def flush(self) -> int:
        """Evict everything that is not locked; returns tokens freed."""
        return self.evict(self.evictable_size)


class NoPrefixCache(PrefixCache):
    """``--disable-radix-cache``: nothing is ever matched or kept."""

    enabled = False

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult([], None, self.page_size)

    def insert(self, key: Sequence[int], pages: Sequence[int], extra_key: str | None = None,
               priority: int = 0) -> int:
        raise RuntimeError("NoPrefixCache does not take pages; free them instead")

    def inc_lock(self, node: Any) -> None:
        pass

    def dec_lock(self, node: Any) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    def owned_pages(self) -> list[int]:
        return []
