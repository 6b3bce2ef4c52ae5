"""How many tokens the KV pool holds: ``--max-total-tokens`` when given, else ``--mem-fraction`` of the
device's free memory (CUDA) or of the host's memory, bounded by a container's cgroup limit (a pod's)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.config import CacheConfig


def pool_tokens(cache: CacheConfig, bytes_per_token: int, device: torch.device) -> int:
    if cache.max_total_tokens:
        return cache.max_total_tokens
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * cache.mem_fraction
    else:
        budget = host_memory_bytes() * cache.mem_fraction
    return int(budget // bytes_per_token)


def host_memory_bytes() -> int:
    """Physical memory, or the container's cgroup limit when that is smaller (a pod's memory limit)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total
