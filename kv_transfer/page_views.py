"""numpy views over a KV layout's pages in this process: gather pages into a block, scatter a block into
pages, or copy pages from one pool straight into another (both mapped here, as with shm)."""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from kv_transfer.wire.layout import KVLayout, page_runs


class PageViews:
    """numpy views [buffer, page, page_bytes] over a layout's K/V buffers in this process (no copies).

    Consecutive buffers (in `bases()` order) that sit at equal distances share one 3-D view, so a packed
    pool (all K buffers evenly spaced, then all V buffers) is gathered or scattered in two numpy calls
    instead of one per buffer."""

    def __init__(self, layout: KVLayout, *, group: bool = True) -> None:
        self.layout = layout
        self.page_bytes = layout.page_bytes
        bases = layout.bases()
        self.num_buffers = len(bases)
        runs: list[list[int]] = []  # consecutive bases with one common gap
        for base in bases:
            run = runs[-1] if runs else None
            if group and run is not None and (len(run) == 1 and base > run[0] or
                                              len(run) > 1 and base - run[-1] == run[1] - run[0]):
                run.append(base)
            else:
                runs.append([base])
        span = (layout.num_pages - 1) * layout.stride + layout.page_bytes
        self.views: list[np.ndarray] = []
        self.counts: list[int] = []
        for run in runs:
            gap = run[1] - run[0] if len(run) > 1 else 0
            self.views.append(_strided(run[0], (len(run) - 1) * gap + span, (len(run), layout.num_pages,
                                       layout.page_bytes), (gap, layout.stride, 1)))
            self.counts.append(len(run))

    @property
    def bytes_per_page(self) -> int:
        """One page over every K/V buffer: what a slot holds per page."""
        return self.page_bytes * self.num_buffers

    def _blocks(self, flat: np.ndarray, count: int) -> list[np.ndarray]:
        rows = flat[:count * self.bytes_per_page].reshape(self.num_buffers, count, self.page_bytes)
        blocks, start = [], 0
        for n in self.counts:
            blocks.append(rows[start:start + n])
            start += n
        return blocks

    def gather(self, pages: Sequence[int], out: np.ndarray) -> int:
        """Copy `pages` of every buffer into `out` in slot format; returns the bytes used."""
        for view, block in zip(self.views, self._blocks(out, len(pages))):
            for i, page in enumerate(pages):  # each copy: this page of every buffer in the run
                np.copyto(block[:, i], view[:, page])
        return len(pages) * self.bytes_per_page

    def scatter(self, block: np.ndarray, pages: Sequence[int]) -> None:
        """Copy a slot-format `block` (as gather wrote it) into `pages` of every buffer."""
        for view, rows in zip(self.views, self._blocks(block, len(pages))):
            for i, page in enumerate(pages):
                np.copyto(view[:, page], rows[:, i])


def _strided(base: int, size: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    flat = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base))
    return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=strides)


def matched_views(src: PageViews, dst: PageViews) -> tuple[PageViews, PageViews]:
    """Views of two pools grouped alike, as copy_pages needs: as given when they are, else one per buffer."""
    if src.counts == dst.counts:
        return src, dst
    return PageViews(src.layout, group=False), PageViews(dst.layout, group=False)


def copy_pages(src: PageViews, dst: PageViews, src_pages: Sequence[int], dst_pages: Sequence[int]) -> int:
    """Copy src_pages of every buffer into dst_pages (views from matched_views), a run of consecutive pages per
    numpy call and buffer group (two calls per run for packed pools, where per-entry memmoves would take
    2 x layers); returns bytes."""
    assert src.counts == dst.counts, "views must come from matched_views"
    for s, d, n in page_runs(src_pages, dst_pages):
        for sv, dv in zip(src.views, dst.views):
            np.copyto(dv[:, d:d + n], sv[:, s:s + n])
    return len(src_pages) * src.bytes_per_page
