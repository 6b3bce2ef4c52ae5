"""Waiting-queue order: fcfs keeps arrival order; lpm puts requests with the longest cached prefix first
(computed only while the queue is short, since every candidate costs a tree walk)."""
from __future__ import annotations

from collections.abc import Callable

from engine.config import EngineConfigError
from engine.request import Request

LPM_MAX_QUEUE = 128


def order_waiting(waiting: list[Request], policy: str, cached_tokens: Callable[[Request], int]) -> list[Request]:
    if policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
        return waiting
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -cached_tokens(r))  # stable: ties keep arrival order
    raise EngineConfigError(f"--schedule-policy {policy!r} is unknown")
