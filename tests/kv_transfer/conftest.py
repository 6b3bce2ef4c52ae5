"""Fixtures for kv_transfer tests: peer processes that are always cleaned up, even on failure."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Iterator

# Plain `pytest` puts tests/ first on sys.path, where this folder would shadow the real kv_transfer
# package as a namespace package (editable installs resolve after sys.path). The repository root first fixes it.
_REPO = str(Path(__file__).resolve().parents[2])
if sys.path[:1] != [_REPO]:
    sys.path.insert(0, _REPO)

import pytest  # noqa: E402

from kv_harness import Peer  # noqa: E402

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
