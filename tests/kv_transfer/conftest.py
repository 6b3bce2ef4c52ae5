"""Fixtures for kv_transfer tests: peer processes that are always cleaned up, even on failure."""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from kv_harness import Peer

BACKENDS_ACROSS_PROCESSES = ("mooncake", "shm")


@pytest.fixture
def spawn() -> Iterator[Callable[..., Peer]]:
    peers: list[Peer] = []

    def make(role: str, backend: str, seed: int = 0, **kwargs: Any) -> Peer:
        peer = Peer(role, backend, seed=seed, **kwargs)
        peers.append(peer)
        return peer

    yield make
    for peer in peers:
        peer.close()
