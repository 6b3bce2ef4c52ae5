"""Transports that move bytes into a peer's registered memory: mooncake, shm, fake.

Each prefill-side writer has one blocking method, `write(entries)`, taking (src_addr, dst_addr,
length) triples in the peer's address space, raising TransferIOError on failure. `select` builds
the decode side's offer and picks the prefill side's writer for it.
"""
from __future__ import annotations

from typing import Protocol

Entry = tuple[int, int, int]


class PeerWriter(Protocol):
    transport: str

    def write(self, entries: list[Entry]) -> None:
        """Copy every entry into the peer; blocks; TransferIOError on failure."""

    def close(self) -> None:
        """Release what the writer holds (mappings); idempotent."""
