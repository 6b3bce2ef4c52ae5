"""Same-host writes: map the decode worker's shared segments and memcpy into them."""
from __future__ import annotations

import bisect
import ctypes
import dataclasses

from kv_transfer.wire.errors import TransferIOError
from kv_transfer.wire.layout import KVLayout
from kv_transfer.page_views import PageViews
from kv_transfer.shm import SharedSegment
from kv_transfer.transport import Entry


class ShmWriter:
    """Translates the peer's addresses into this process's mappings of its segments."""

    transport = "shm"

    def __init__(self, regions: list[tuple[str, bytes, int, int]]) -> None:
        """regions: (segment name, nonce, peer-side base address, size). ConfigError if unmappable."""
        self._maps: list[tuple[int, int, SharedSegment]] = []
        try:
            for name, nonce, base, size in regions:
                seg = SharedSegment.open(name, nonce)
                self._maps.append((base, min(size, seg.size), seg))
        except Exception:
            self.close()
            raise
        self._maps.sort(key=lambda m: m[0])
        self._starts = [m[0] for m in self._maps]

    def _local(self, dst: int, length: int) -> int:
        i = bisect.bisect_right(self._starts, dst) - 1
        if i >= 0:
            base, size, seg = self._maps[i]
            if dst + length <= base + size:
                return seg.address + (dst - base)
        raise TransferIOError(f"destination {dst:#x}+{length} is outside the peer's shared segments", rc=-1)

    def map_pool(self, layout: KVLayout) -> PageViews:
        """The peer's KV pool as numpy views of this process's mappings (TransferIOError if outside them), so
        whole page runs can be copied without building one entry per page and buffer."""
        span = (layout.num_pages - 1) * layout.stride + layout.page_bytes
        local = dataclasses.replace(layout, k_base=tuple(self._local(a, span) for a in layout.k_base),
                                    v_base=tuple(self._local(a, span) for a in layout.v_base))
        return PageViews(local)

    def write(self, entries: list[Entry]) -> None:
        targets = [self._local(dst, length) for _, dst, length in entries]  # check all before writing
        for (src, _, length), local in zip(entries, targets):
            ctypes.memmove(local, src, length)  # releases the GIL

    def close(self) -> None:
        for _, _, seg in self._maps:
            seg.close()
        self._maps = []
        self._starts = []
