"""The numpy page views behind staged writes and shm copies move exactly the listed pages, on packed, strided
and shuffled layouts, checked against plain byte slicing: gather into the slot format then scatter, and a
direct copy between two pools (also when their buffers are grouped differently)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kv_transfer import KVLayout
from kv_transfer.page_views import PageViews, copy_pages, matched_views

KINDS = ["packed", "strided", "shuffled"]


def _layout(base: int, kind: str, rng: random.Random, pages: int = 12) -> tuple[KVLayout, int]:
    """A 3-layer layout over memory at `base`; returns it and the bytes it spans."""
    page = 4 * 2 * 8 * 2  # page_size 4, 2 heads, dim 8, float16
    stride = page * 3 if kind == "strided" else page
    buffer = (pages - 1) * stride + page
    order = list(range(6))
    if kind == "shuffled":
        rng.shuffle(order)
    addrs = [base + i * buffer for i in order]
    layout = KVLayout(num_layers=3, page_size=4, num_kv_heads=2, head_dim=8, dtype="float16", num_pages=pages,
                      k_base=tuple(addrs[:3]), v_base=tuple(addrs[3:]), page_stride=stride if kind == "strided" else 0)
    return layout, 6 * buffer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gather_then_scatter_moves_exactly_the_listed_pages(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    src_mem = np.random.default_rng(seed).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst_mem = np.random.default_rng(seed + 100).integers(0, 256, 1 << 16, dtype=np.uint8)
    src, span = _layout(int(src_mem.ctypes.data), kind, rng)
    dst, _ = _layout(int(dst_mem.ctypes.data), kind, random.Random(seed))  # same shuffle as src
    assert span <= src_mem.nbytes
    before = dst_mem.copy()
    src_pages, dst_pages = rng.sample(range(12), 5), rng.sample(range(12), 5)
    block = np.zeros(5 * 6 * src.page_bytes, dtype=np.uint8)
    assert PageViews(src).gather(src_pages, block) == block.nbytes
    PageViews(dst).scatter(block, dst_pages)

    def page_of(mem: np.ndarray, layout: KVLayout, buf: int, page: int, origin: np.ndarray | None = None) -> bytes:
        """Page `page` of buffer `buf`, read from `mem` (or a copy of it, then `origin` is the original)."""
        off = layout.bases()[buf] - int((mem if origin is None else origin).ctypes.data) + page * layout.stride
        return mem[off:off + layout.page_bytes].tobytes()

    for b in range(6):
        for i, (s, d) in enumerate(zip(src_pages, dst_pages)):
            # slot format: buffer-major, the listed pages back to back
            start = (b * 5 + i) * src.page_bytes
            assert block[start:start + src.page_bytes].tobytes() == page_of(src_mem, src, b, s)
            assert page_of(dst_mem, dst, b, d) == page_of(src_mem, src, b, s)
        for p in set(range(12)) - set(dst_pages):
            assert page_of(dst_mem, dst, b, p) == page_of(before, dst, b, p, origin=dst_mem)




def _page(mem: np.ndarray, layout: KVLayout, buf: int, page: int, origin: np.ndarray | None = None) -> bytes:
    off = layout.bases()[buf] - int((mem if origin is None else origin).ctypes.data) + page * layout.stride
    return mem[off:off + layout.page_bytes].tobytes()


@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
def test_copy_pages_between_pools_moves_exactly_the_listed_pages(src_kind: str, dst_kind: str) -> None:
    rng = random.Random(f"{src_kind}-{dst_kind}")
    src_mem = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
    dst_mem = np.random.default_rng(2).integers(0, 256, 1 << 16, dtype=np.uint8)
    src, _ = _layout(int(src_mem.ctypes.data), src_kind, rng)
    dst, _ = _layout(int(dst_mem.ctypes.data), dst_kind, rng)
    before = dst_mem.copy()
    # a contiguous run (coalesced into one copy per buffer group) followed by scattered pages
    src_pages = [2, 3, 4, 5] + rng.sample(range(6, 12), 3)
    dst_pages = [7, 8, 9, 10] + rng.sample([0, 1, 2, 3, 4, 5], 3)
    views = matched_views(PageViews(src), PageViews(dst))  # regrouped per buffer when the layouts differ
    assert copy_pages(*views, src_pages, dst_pages) == 7 * 6 * src.page_bytes
    for b in range(6):
        for s, d in zip(src_pages, dst_pages):
            assert _page(dst_mem, dst, b, d) == _page(src_mem, src, b, s)
        for p in set(range(12)) - set(dst_pages):
            assert _page(dst_mem, dst, b, p) == _page(before, dst, b, p, origin=dst_mem)
