"""Transports that move bytes into a peer's registered memory: mooncake, shm, fake.

Each prefill-side writer has one blocking method, `write(entries)`, taking (src_addr, dst_addr,
length) triples in the peer's address space, raising TransferIOError on failure. `select` builds
the decode side's offer and picks the prefill side's writer for it.
"""
from __future__ import annotations

from typing import Callable, Protocol

Entry = tuple[int, int, int]


class PeerWriter(Protocol):
    transport: str

    def write(self, entries: list[Entry]) -> None:
        """Copy every entry into the peer; blocks; TransferIOError on failure."""

    def start_write(self, entries: list[Entry]) -> Callable[[], None]:
        """Begin copying; returns a function that waits for the copy (TransferIOError on failure)."""

    def register_source(self, region: tuple[int, int]) -> None:
        """Make a local buffer (a staging gather buffer) writable from; unregistered again by close()."""

    def close(self) -> None:
        """Release what the writer holds (mappings); idempotent."""
