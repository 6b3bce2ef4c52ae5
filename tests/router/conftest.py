"""Fixtures for the router's integration tests: real processes on 127.0.0.1."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Cluster  # noqa: E402

pytest.importorskip("router._router", reason="the router extension is not built; run `pip install -e .`")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()
