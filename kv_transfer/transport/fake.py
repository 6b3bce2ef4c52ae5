"""In-process transport for unit tests of the callers: memcpy between two managers in one process.

It checks destinations against the regions the receiving manager registered, like Mooncake's
server does, and `FAULTS` lets a test make writes fail or stall.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
from dataclasses import dataclass

from kv_transfer.wire.errors import TransferIOError, TransportMismatchError
from kv_transfer.transport import Entry

_lock = threading.Lock()
_sessions: dict[str, list[tuple[int, int]]] = {}
_ids = itertools.count(1)


@dataclass
class FakeFaults:
    fail_writes: bool = False  # every write raises TransferIOError(rc=-1)
    write_delay: float = 0.0   # seconds each write sleeps first


FAULTS = FakeFaults()


def register_session(regions: list[tuple[int, int]]) -> str:
    session = f"fake-{os.getpid()}-{next(_ids)}"
    with _lock:
        _sessions[session] = list(regions)
    return session


def unregister_session(session: str) -> None:
    with _lock:
        _sessions.pop(session, None)


class FakeWriter:
    transport = "fake"

    def __init__(self, session: str) -> None:
        if not session.startswith(f"fake-{os.getpid()}-"):
            raise TransportMismatchError(
                f"fake transport session {session!r} belongs to another process; "
                "the fake backend only works in-process (use shm or mooncake across processes)"
            )
        self.session = session

    def write(self, entries: list[Entry]) -> None:
        if FAULTS.write_delay:
            time.sleep(FAULTS.write_delay)
        if FAULTS.fail_writes:
            raise TransferIOError("fake transport: injected write failure", rc=-1, peer=self.session)
        with _lock:
            regions = _sessions.get(self.session)
        if regions is None:
            raise TransferIOError("fake transport: peer session is gone", rc=-1, peer=self.session)
        for _, dst, length in entries:
            if not any(a <= dst and dst + length <= a + n for a, n in regions):
                raise TransferIOError(f"fake transport: {dst:#x}+{length} is not registered", rc=-1,
                                      peer=self.session)
        for src, dst, length in entries:
            ctypes.memmove(dst, src, length)

    def close(self) -> None:
        pass
