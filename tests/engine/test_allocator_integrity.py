"""The page allocator hands out each page once and its integrity check catches double ownership and leaks."""
from __future__ import annotations

import pytest

from engine.mem.allocator import AllocatorIntegrityError, PageAllocator


def test_alloc_prefers_low_contiguous_pages_and_refuses_overcommit() -> None:
    a = PageAllocator(10)
    assert a.capacity == 9 and a.alloc(3) == [1, 2, 3]
    assert a.alloc(7) is None and a.available == 6
    a.free([2])
    assert a.alloc(2) == [2, 4]
    a.check_integrity([[1, 3], [2, 4]])


def test_integrity_check_finds_double_ownership_and_leaks() -> None:
    a = PageAllocator(6)
    pages = a.alloc(3)
    assert pages is not None
    with pytest.raises(AllocatorIntegrityError, match="leaked"):
        a.check_integrity([pages[:2]])
    with pytest.raises(AllocatorIntegrityError, match="also"):
        a.check_integrity([pages, pages[:1]])
    a.free(pages[:1])
    with pytest.raises(AllocatorIntegrityError, match="also free"):
        a.check_integrity([pages])
