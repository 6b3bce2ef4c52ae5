"""Page allocator for the paged KV pool. Page 0 is reserved as the null page (padding reads land there)."""
from __future__ import annotations

from collections.abc import Iterable


class AllocatorIntegrityError(AssertionError):
    """The allocator's bookkeeping disagrees with the owners it was checked against."""


class PageAllocator:
    """Hands out page indices; prefers low indices so a request's pages tend to be contiguous (contiguous runs
    make KV transfers coalesce into fewer, larger writes)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"need at least 2 pages (one is reserved), got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # descending: pop() yields the lowest
        self._sorted = True

    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out (all but the null page)."""
        return self.num_pages - 1

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Return ``n`` pages in ascending order, or None (and allocate nothing) if fewer are free."""
        if n <= 0:
            return []
        if n > len(self._free):
            return None
        if not self._sorted:
            self._free.sort(reverse=True)
            self._sorted = True
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        return pages

    def free(self, pages: Iterable[int]) -> None:
        before = len(self._free)
        self._free.extend(pages)
        if len(self._free) != before:
            self._sorted = False

    def check_integrity(self, owners: Iterable[Iterable[int]]) -> None:
        """Raise unless every page is exactly one of: free, or owned by exactly one owner."""
        seen: dict[int, str] = {}
        for page in self._free:
            if page in seen:
                raise AllocatorIntegrityError(f"page {page} is on the free list twice")
            if not 0 < page < self.num_pages:
                raise AllocatorIntegrityError(f"free list holds out-of-range page {page}")
            seen[page] = "free"
        for i, owned in enumerate(owners):
            for page in owned:
                if page in seen:
                    raise AllocatorIntegrityError(f"page {page} owned by owner {i} is also {seen[page]}")
                if not 0 < page < self.num_pages:
                    raise AllocatorIntegrityError(f"owner {i} holds out-of-range page {page}")
                seen[page] = f"owned by owner {i}"
        if len(seen) != self.capacity:
            lost = sorted(set(range(1, self.num_pages)) - set(seen))[:10]
            raise AllocatorIntegrityError(f"{self.capacity - len(seen)} pages are neither free nor owned "
                                          f"(leaked), e.g. {lost}")
