"""SharedSegment: the decode pool's memory, created by name, mapped by the prefill side, removed on close."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kv_transfer import ConfigError, SharedSegment
from kv_transfer.shm import SHM_DIR


def test_segment_round_trip_and_cleanup() -> None:
    seg = SharedSegment.create(8192)
    try:
        view = np.frombuffer(seg.buffer, dtype=np.uint8)  # what torch.frombuffer would wrap
        view[:4] = [1, 2, 3, 4]
        other = SharedSegment.open(seg.name, seg.nonce)
        assert bytes(other.buffer[:4]) == b"\x01\x02\x03\x04" and other.size == seg.size == 8192
        other.buffer[4] = 9
        assert view[4] == 9
        other.close()
        with pytest.raises(ConfigError, match="not the peer's"):
            SharedSegment.open(seg.name, b"\0" * 16)
        del view
    finally:
        seg.close()
    assert not (SHM_DIR / seg.name).exists()
    with pytest.raises(ConfigError, match="cannot open"):
        SharedSegment.open(seg.name)


def test_segments_of_dead_processes_are_swept() -> None:
    code = "from kv_transfer import SharedSegment; s = SharedSegment.create(4096); print(s.name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    leaked = SHM_DIR / out.stdout.strip()
    assert leaked.exists()  # the process exited without close()
    SharedSegment.create(4096).close()
    assert not leaked.exists()
