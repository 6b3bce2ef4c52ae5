"""The Mooncake Transfer Engine (TCP here; RDMA/NVLink on clusters), wrapped so nothing fails silently.

Every Mooncake call returns an int (0 ok, negative failure) and never raises; each is checked and
turned into a TransferIOError/ConfigError carrying the code, the peer and the room. A frozen peer
can block a call for 30-61 s, so callers run writes off their own thread with their own deadlines.
Security: Mooncake's handshake and data ports listen on 0.0.0.0 without authentication; bound
them with --transfer-rpc-port-min/max and keep them inside a trusted network.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

from kv_transfer.config import TransferConfig
from kv_transfer.wire.errors import ConfigError, TransferIOError
from kv_transfer.transport import Entry

log = logging.getLogger("kv_transfer")

# Mooncake (and the glog inside it) read their log levels when the library loads: quiet them before any import.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("GLOG_minloglevel", "2")


def mooncake_available() -> bool:
    try:
        import mooncake.engine as engine
    except ImportError:
        return False
    return engine is not None


class MooncakeEngine:
    """One initialized TransferEngine per manager; `session` is what peers write to."""

    def __init__(self, config: TransferConfig) -> None:
        config.apply_mooncake_env()
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ConfigError(
                f"cannot import mooncake ({exc}); install mooncake-transfer-engine-non-cuda (CPU) or "
                "mooncake-transfer-engine (CUDA) and the Debian package libibverbs1"
            ) from exc
        self._engine: Any = TransferEngine()
        host = config.resolved_hostname()
        rc = self._engine.initialize(host, config.metadata_server, config.protocol, config.device_name)
        if rc != 0:
            raise ConfigError(f"Mooncake initialize({host}, {config.metadata_server}, {config.protocol}) "
                              f"returned {rc}; check --transfer-protocol/--transfer-device-name")
        self.session = host if ":" in host else f"{host}:{self._engine.get_rpc_port()}"
        self._registered: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        log.info("mooncake engine up session=%s protocol=%s", self.session, config.protocol)

    def register(self, regions: list[tuple[int, int]]) -> None:
        with self._lock:
            if self._engine is None:
                raise ConfigError("the Mooncake engine was shut down")
            for addr, length in regions:
                if (addr, length) in self._registered:
                    continue
                rc = self._engine.register_memory(addr, length)
                if rc != 0:
                    raise ConfigError(f"Mooncake register_memory({addr:#x}, {length}) returned {rc}")
                self._registered.add((addr, length))

    def unregister(self, region: tuple[int, int]) -> None:
        with self._lock:
            if region not in self._registered or self._engine is None:
                return
            self._registered.discard(region)
            rc = self._engine.unregister_memory(region[0])
        if rc != 0:
            log.warning("Mooncake unregister_memory(%#x) returned %d", region[0], rc)

    def shutdown(self) -> None:
        """Drop the engine (its threads and ports go with it); later calls fail with ConfigError."""
        with self._lock:
            engine, self._engine = self._engine, None
            self._registered.clear()
        del engine

    def start_write(self, session: str, entries: list[Entry]) -> Callable[[], None]:
        """Submit without waiting; the returned function waits (bounded by Mooncake's transfer timeout)."""
        if self._engine is None:
            raise ConfigError("the Mooncake engine was shut down")
        engine = self._engine
        batch = engine.batch_transfer_async_write(session, [e[0] for e in entries], [e[1] for e in entries],
                                                  [e[2] for e in entries])
        if batch == 0:
            raise TransferIOError(f"Mooncake could not submit a write of {len(entries)} entries", rc=-1,
                                  peer=session)

        result: list[int] = []

        def wait() -> None:
            if not result:  # Mooncake frees the batch once waited on: never ask twice
                result.append(engine.get_batch_transfer_status([batch]))
            if result[0] != 0:
                raise TransferIOError(f"Mooncake write of {len(entries)} entries failed", rc=result[0], peer=session)
        return wait

    def write(self, session: str, entries: list[Entry]) -> None:
        if self._engine is None:
            raise ConfigError("the Mooncake engine was shut down")
        srcs = [e[0] for e in entries]
        dsts = [e[1] for e in entries]
        lens = [e[2] for e in entries]
        start = time.monotonic()
        rc = self._engine.batch_transfer_sync_write(session, srcs, dsts, lens)
        took = time.monotonic() - start
        if took > 1.0:
            log.warning("slow Mooncake write peer=%s entries=%d seconds=%.1f rc=%d", session, len(entries), took, rc)
        if rc != 0:
            raise TransferIOError(f"Mooncake batch write of {len(entries)} entries failed", rc=rc, peer=session)


class MooncakeWriter:
    transport = "mooncake"

    def __init__(self, engine: MooncakeEngine, peer_session: str, *, owns_engine: bool = False) -> None:
        self._engine = engine
        self.peer_session = peer_session
        self._owns_engine = owns_engine
        self._sources: list[tuple[int, int]] = []

    def register_source(self, region: tuple[int, int]) -> None:
        """Register a local buffer (a staging gather buffer) to write from; unregistered again by close()."""
        self._engine.register([region])
        self._sources.append(region)

    def write(self, entries: list[Entry]) -> None:
        self._engine.write(self.peer_session, entries)

    def start_write(self, entries: list[Entry]) -> Callable[[], None]:
        return self._engine.start_write(self.peer_session, entries)

    def close(self) -> None:
        """Runs on the peer's writer thread after its last write, so nothing is in flight."""
        for region in self._sources:
            self._engine.unregister(region)
        self._sources.clear()
        if self._owns_engine:
            self._engine.shutdown()
