"""HiCache's host tier as the radix tree sees it: the L2 pool, the device pool it copies to and from, the
device allocator load-back takes pages from, the write policy, and the counters /metrics reports. The tree
decides what moves where (engine/mem/radix_cache.py); this object moves it and counts it."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.config import HICACHE_WRITE_POLICIES, CacheConfig, EngineConfigError
from engine.mem.allocator import PageAllocator
from engine.mem.host_pool import HostPool
from engine.mem.kv_pool import KVPool


@dataclass
class HiCacheStats:
    """Monotonic counters since start (read by /metrics and /get_server_info)."""

    loaded_tokens: int = 0  # tokens copied L2 -> L1 (prefix hits served from the host tier)
    loaded_bytes: int = 0
    written_tokens: int = 0  # tokens copied L1 -> L2
    written_bytes: int = 0
    load_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=4096))  # drained by metrics


class HostTier:
    def __init__(self, host: HostPool, kv: KVPool, device: PageAllocator, write_policy: str = "write_through",
                 write_threshold: int = 2) -> None:
        if write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"write policy {write_policy!r} is not one of {', '.join(HICACHE_WRITE_POLICIES)}")
        self.host = host
        self.kv = kv
        self.device = device
        self.write_policy = write_policy
        self.write_threshold = write_threshold
        self.stats = HiCacheStats()
        self._loading_since: float | None = None

    # -- what the tree asks ------------------------------------------------------------------------------------
    def mirrors(self, hits: int) -> bool:
        """Should an L1 node with ``hits`` be copied to L2 now (rather than when it is evicted)?"""
        if self.write_policy == "write_through":
            return True
        return self.write_policy == "write_through_selective" and hits >= self.write_threshold

    def device_available(self) -> int:
        return self.device.available

    def alloc_device(self, n: int) -> list[int] | None:
        return self.device.alloc(n)

    def host_available(self) -> int:
        return self.host.allocator.available

    def alloc_host(self, n: int) -> list[int] | None:
        return self.host.allocator.alloc(n)

    def free_host(self, pages: Sequence[int]) -> None:
        self.host.allocator.free(pages)

    # -- copies --------------------------------------------------------------------------------------------------
    def save(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        self.stats.written_bytes += self.host.save(self.kv, device_pages, host_pages)
        self.stats.written_tokens += len(host_pages) * self.host.shape.page_size

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        if self._loading_since is None:
            self._loading_since = time.perf_counter()
        self.stats.loaded_bytes += self.host.load(self.kv, host_pages, device_pages)

    def loaded(self, tokens: int) -> None:
        """One load-back finished with ``tokens`` loaded (its copies were ``load`` calls since the last one)."""
        if self._loading_since is not None:
            self.stats.load_seconds.append(time.perf_counter() - self._loading_since)
            self._loading_since = None
        self.stats.loaded_tokens += tokens

    def check_integrity(self, owned: Sequence[int]) -> None:
        self.host.allocator.check_integrity([owned])

    def describe(self) -> dict[str, int | str]:
        s = self.stats
        return {"write_policy": self.write_policy, "host_pages_total": self.host.allocator.capacity,
                "host_pages_used": self.host.allocator.used, "loaded_tokens": s.loaded_tokens,
                "loaded_bytes": s.loaded_bytes, "written_tokens": s.written_tokens,
                "written_bytes": s.written_bytes}


def host_tier_for(cfg: CacheConfig, pool: KVPool, device_pages: PageAllocator,
                  device: torch.device) -> HostTier | None:
    """The host tier ``cfg`` asks for (--hicache-size GB, or --hicache-ratio times the device pool), or None."""
    if not cfg.enable_hierarchical_cache:
        return None
    page_bytes = pool.shape.page_size * pool.shape.bytes_per_token
    pages = (int(cfg.hicache_size * 1e9 // page_bytes) if cfg.hicache_size else
             int(device_pages.capacity * cfg.hicache_ratio))
    if pages < 1:
        raise EngineConfigError(f"--hicache-size {cfg.hicache_size} GB holds no page ({page_bytes} bytes each)")
    return HostTier(HostPool(pool.shape, pages + 1, device), pool, device_pages, cfg.hicache_write_policy,
                    cfg.hicache_write_threshold)
