"""Counters the workers export to Prometheus: bytes, transfer duration, failures by reason, rooms by state.

`TransferMetrics` keeps plain thread-safe counters (read them with `snapshot()`); pass a
prometheus_client registry to also publish them as
  splitserve_kv_transfer_bytes_total{role}
  splitserve_kv_transfer_staged_bytes_total{role}         (the part of it written through staging slots)
  splitserve_kv_transfer_duration_seconds{role}          (histogram, first write to Success)
  splitserve_kv_transfer_failures_total{role,reason}
  splitserve_kv_transfer_rooms{role,state}               (gauge: rooms currently in each state)
The workers own the registry; one TransferMetrics per manager (role = "prefill" or "decode").
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from kv_transfer.state import FailureKind, RoomState

DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TransferMetrics:
    def __init__(self, role: str, registry: Any | None = None, prefix: str = "splitserve_") -> None:
        self.role = role
        self._lock = threading.Lock()
        self.bytes_total = 0
        self.staged_bytes_total = 0
        self.transfers_total = 0
        self.duration_seconds_sum = 0.0
        self.failures: Counter[str] = Counter()
        self.rooms: Counter[RoomState] = Counter()
        self._prom: dict[str, Any] = {}
        if registry is not None:
            self._init_prometheus(registry, prefix)

    def _init_prometheus(self, registry: Any, prefix: str) -> None:
        from prometheus_client import Counter as PCounter, Gauge, Histogram

        self._prom = {
            "bytes": PCounter(f"{prefix}kv_transfer_bytes", "KV bytes written/received", ["role"],
                              registry=registry),
            "staged": PCounter(f"{prefix}kv_transfer_staged_bytes", "KV bytes written through staging slots "
                               "(scattered pages sent as one block and copied into place)", ["role"],
                               registry=registry),
            "duration": Histogram(f"{prefix}kv_transfer_duration_seconds",
                                  "Room transfer time, first write to Success", ["role"],
                                  buckets=DURATION_BUCKETS, registry=registry),
            "failures": PCounter(f"{prefix}kv_transfer_failures", "Failed rooms by reason",
                                 ["role", "reason"], registry=registry),
            "rooms": Gauge(f"{prefix}kv_transfer_rooms", "Rooms currently in each state",
                           ["role", "state"], registry=registry),
        }
        for kind in FailureKind:
            self._prom["failures"].labels(role=self.role, reason=kind.value)
        for state in RoomState:
            self._prom["rooms"].labels(role=self.role, state=state.name.lower()).set(0)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_total += n
        if self._prom:
            self._prom["bytes"].labels(role=self.role).inc(n)

    def add_staged_bytes(self, n: int) -> None:
        with self._lock:
            self.staged_bytes_total += n
        if self._prom:
            self._prom["staged"].labels(role=self.role).inc(n)

    def observe_transfer(self, seconds: float) -> None:
        with self._lock:
            self.transfers_total += 1
            self.duration_seconds_sum += seconds
        if self._prom:
            self._prom["duration"].labels(role=self.role).observe(seconds)

    def room_changed(self, old: RoomState | None, new: RoomState | None) -> None:
        """A room entered `new` (None: removed) from `old` (None: created)."""
        with self._lock:
            if old is not None:
                self.rooms[old] -= 1
            if new is not None:
                self.rooms[new] += 1
        if self._prom:
            gauge = self._prom["rooms"]
            if old is not None:
                gauge.labels(role=self.role, state=old.name.lower()).dec()
            if new is not None:
                gauge.labels(role=self.role, state=new.name.lower()).inc()

    def failed(self, kind: FailureKind) -> None:
        with self._lock:
            self.failures[kind.value] += 1
        if self._prom:
            self._prom["failures"].labels(role=self.role, reason=kind.value).inc()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "bytes_total": self.bytes_total,
                "staged_bytes_total": self.staged_bytes_total,
                "transfers_total": self.transfers_total,
                "duration_seconds_sum": self.duration_seconds_sum,
                "failures": dict(self.failures),
                "rooms": {s.name: n for s, n in self.rooms.items() if n},
            }
