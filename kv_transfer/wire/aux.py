"""The aux record: first output token id, number of cached prompt tokens, room id, and an optional opaque
payload the workers define (the first token's log-probabilities, when the request asked for them).

The decode side owns an array of fixed-size records (an AuxLayout: base address, slot count,
record stride) registered like its KV memory. The prefill side writes a room's record with its
last pages; the decode side checks the room id before trusting the pages.
"""
from __future__ import annotations

import ctypes
import queue
import struct
from dataclasses import dataclass

import numpy as np

from kv_transfer.wire.errors import ConfigError, PageIndexError

RECORD_FORMAT = "<qqqI"  # first_token_id, cached_tokens, room (int64s), payload length (uint32), little-endian
RECORD_SIZE = struct.calcsize(RECORD_FORMAT)  # the header; the payload follows it
MAX_RECORD_BYTES = 512  # the largest record a prefill worker stages
MAX_EXTRA_PAYLOAD = 48 << 20  # the largest payload a Success event carries (the decode side's gRPC limit is above)
EMPTY_ROOM = -1


@dataclass(frozen=True)
class AuxRecord:
    first_token_id: int
    cached_tokens: int
    room: int
    payload: bytes = b""

    def pack(self) -> bytes:
        return struct.pack(RECORD_FORMAT, self.first_token_id, self.cached_tokens, self.room,
                           len(self.payload)) + self.payload

    @classmethod
    def unpack(cls, data: bytes) -> "AuxRecord":
        first, cached, room, n = struct.unpack(RECORD_FORMAT, data[:RECORD_SIZE])
        payload = bytes(data[RECORD_SIZE:RECORD_SIZE + n]) if RECORD_SIZE + n <= len(data) else b""
        return cls(first, cached, room, payload)


@dataclass(frozen=True)
class AuxLayout:
    base: int
    num_slots: int
    record_bytes: int = 32

    def __post_init__(self) -> None:
        if self.num_slots <= 0:
            raise ConfigError(f"AuxLayout.num_slots must be > 0, got {self.num_slots}")
        if self.record_bytes < RECORD_SIZE:
            raise ConfigError(f"AuxLayout.record_bytes must be >= {RECORD_SIZE}, got {self.record_bytes}")

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.record_bytes

    def slot_address(self, slot: int, *, room: int | None = None) -> int:
        if not 0 <= slot < self.num_slots:
            raise PageIndexError(f"aux slot {slot} is outside [0, {self.num_slots})", room=room)
        return self.base + slot * self.record_bytes

    def read(self, slot: int) -> AuxRecord:
        """Read a record from this process's memory (decode side)."""
        return AuxRecord.unpack(ctypes.string_at(self.slot_address(slot), self.record_bytes))

    def clear(self, slot: int) -> None:
        data = AuxRecord(0, 0, EMPTY_ROOM).pack()
        ctypes.memmove(self.slot_address(slot), data, len(data))


class AuxBuffer:
    """A process-local aux array (numpy). For shm, build an AuxLayout inside a SharedSegment instead."""

    def __init__(self, num_slots: int, record_bytes: int = 32) -> None:
        self.array = np.zeros(num_slots * record_bytes, dtype=np.uint8)
        self.layout = AuxLayout(int(self.array.ctypes.data), num_slots, record_bytes)
        for slot in range(num_slots):
            self.layout.clear(slot)


class AuxStaging:
    """Prefill side: registered source records for aux writes, one per room being finished."""

    def __init__(self, num_slots: int, record_bytes: int = MAX_RECORD_BYTES) -> None:
        self._buf = AuxBuffer(num_slots, record_bytes)
        self.region = (self._buf.layout.base, self._buf.layout.total_bytes)
        self._free: "queue.Queue[int]" = queue.Queue()
        for slot in range(num_slots):
            self._free.put(slot)

    def acquire(self, record: AuxRecord, timeout: float) -> int:
        """A slot holding `record`; ConfigError if none frees up within `timeout`."""
        try:
            slot = self._free.get(timeout=timeout)
        except queue.Empty:
            raise ConfigError("all aux staging slots are busy; raise --transfer-aux-staging-slots") from None
        data = record.pack()
        if len(data) > self._buf.layout.record_bytes:
            self._free.put(slot)
            raise ConfigError(f"aux record of {len(data)} bytes exceeds the {self._buf.layout.record_bytes}-byte "
                              "staging records")
        ctypes.memmove(self._buf.layout.slot_address(slot), data, len(data))
        return slot

    def address(self, slot: int) -> int:
        return self._buf.layout.slot_address(slot)

    def release(self, slot: int) -> None:
        self._free.put(slot)
