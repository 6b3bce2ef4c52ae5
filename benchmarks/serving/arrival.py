"""When each item of a phase starts: offsets in seconds from the phase start, drawn from the seed. Fixed
concurrency is not an arrival schedule but a cap the runner applies on top (rate inf + --max-concurrency)."""
from __future__ import annotations

import math
import random

from benchmarks.serving.config import ConfigError


def start_offsets(n: int, rate: float, arrival: str, seed: int, burst_size: int = 1) -> list[float]:
    """Non-decreasing start offsets of ``n`` items at ``rate`` items/s (inf: all at 0).

    poisson: exponential gaps with mean 1/rate (the first item at 0); constant: every 1/rate;
    burst: ``burst_size`` items together, bursts every burst_size/rate seconds (same mean rate)."""
    if n < 0:
        raise ValueError("n must be >= 0")
    if math.isinf(rate):
        return [0.0] * n
    if arrival == "constant":
        return [i / rate for i in range(n)]
    if arrival == "burst":
        return [(i // burst_size) * burst_size / rate for i in range(n)]
    if arrival == "poisson":
        rng = random.Random(f"arrival-{seed}-{rate}")
        offsets, t = [], 0.0
        for i in range(n):
            if i:
                t += rng.expovariate(rate)
            offsets.append(t)
        return offsets
    raise ConfigError(f"unknown arrival {arrival!r} (poisson, constant, burst)")
