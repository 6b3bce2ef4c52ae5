"""``--hicache-storage-backend mooncake``: HiCache's shared tier in a Mooncake Store cluster.

A Mooncake Store is a ``mooncake_master`` (metadata: which client's memory holds which key) plus the memory
its clients contribute (``global_segment_size`` each): every worker that joins gives a segment and reads any
entry over the transfer engine (TCP here, RDMA on clusters). Entries live in RAM, so they go when the store
evicts them (it does when 90% full) or when the worker whose segment holds them leaves: both are misses.

Settings come from ``--hicache-storage-backend-extra-config`` (SGLang's flag and key names), a JSON object::

    {"master_server_address": "10.0.0.5:50051",   # required
     "metadata_server": "P2PHANDSHAKE",           # or an etcd / http metadata URL
     "global_segment_size": "4gb",                # memory this worker gives the store (bytes or kb/mb/gb)
     "local_buffer_size": "16mb", "protocol": "tcp", "device_name": "",
     "local_hostname": ""}                        # empty: the address this host reaches the master from

Every call is a batch (one round trip to the master per lookup); Mooncake returns codes, never raises: each
is checked and turned into StoreError (StoreUnreachable when the master does not answer). Deadlines are the
guard's (engine/mem/store_guard.py)."""
from __future__ import annotations

import json
import os
import re
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from engine.mem.storage import PageStore, StoreError, StoreUnreachable

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # read when the library loads: quiet its per-call logging
os.environ.setdefault("GLOG_minloglevel", "2")
RPC_FAILURES = range(-999, -899)  # Mooncake's RPC_FAIL group: the master did not answer
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


class MooncakeConfigError(ValueError):
    """The extra config is malformed (a start-up error naming the flag)."""


def _size(name: str, value: object) -> int:
    if isinstance(value, int) and value > 0:
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?b?)\s*", str(value).lower())
    if m is None or float(m.group(1)) <= 0:
        raise MooncakeConfigError(f"{name} must be a positive size in bytes or with kb/mb/gb, not {value!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).rstrip("b")])


@dataclass(frozen=True)
class MooncakeStoreOptions:
    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 4 << 30
    local_buffer_size: int = 16 << 20
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = ""

    @staticmethod
    def parse(text: str | None) -> MooncakeStoreOptions:
        try:
            raw: Any = json.loads(text or "{}")
        except json.JSONDecodeError as e:
            raise MooncakeConfigError(f"is not JSON: {e}") from e
        if not isinstance(raw, dict):
            raise MooncakeConfigError("must be a JSON object")
        known = {f.name for f in fields(MooncakeStoreOptions)}
        if unknown := sorted(set(raw) - known):
            raise MooncakeConfigError(f"unknown key {unknown[0]!r}; the keys are {', '.join(sorted(known))}")
        address = raw.get("master_server_address")
        if not isinstance(address, str) or not re.fullmatch(r".+:\d{1,5}", address):
            raise MooncakeConfigError('needs "master_server_address": "HOST:PORT" of the mooncake_master')
        for key in ("metadata_server", "protocol", "device_name", "local_hostname"):
            if not isinstance(raw.get(key, ""), str):
                raise MooncakeConfigError(f"{key} must be a string, not {raw[key]!r}")
        for key in ("global_segment_size", "local_buffer_size"):
            if key in raw:
                raw[key] = _size(key, raw[key])
        return MooncakeStoreOptions(**raw)

    @property
    def max_batch_bytes(self) -> int:
        """Mooncake stages each batch through the client's local buffer: a batch that does not fit fails whole
        (a put returns -600, a get returns empty entries), so calls move at most half of it."""
        return self.local_buffer_size // 2

    def master(self) -> tuple[str, int]:
        host, _, port = self.master_server_address.rpartition(":")
        return host, int(port)

    def hostname(self) -> str:
        """The address other clients reach this one at: given, or the one this host routes to the master from."""
        if self.local_hostname:
            return self.local_hostname
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(self.master())  # UDP: picks the route, sends nothing
            return s.getsockname()[0]


class MooncakeStore(PageStore):
    """Calls are serialised on one lock: the engine's reads and the writer's puts share the client's local
    buffer, and overlapping batches overflow it."""

    name = "mooncake"

    def __init__(self, opts: MooncakeStoreOptions, connect_timeout: float = 2.0) -> None:
        self.max_batch_bytes = opts.max_batch_bytes
        self._lock = threading.Lock()
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise StoreError(f"cannot import mooncake.store ({e}): install mooncake-transfer-engine-non-cuda "
                             "(CPU) or mooncake-transfer-engine (CUDA)") from e
        try:  # a refused master fails here at once; the client's own setup() would retry for 90 s
            socket.create_connection(opts.master(), timeout=connect_timeout).close()
        except OSError as e:
            raise StoreUnreachable(f"mooncake master {opts.master_server_address}: {e}") from e
        self._store: Any = MooncakeDistributedStore()
        rc = self._store.setup(opts.hostname(), opts.metadata_server, opts.global_segment_size,
                               opts.local_buffer_size, opts.protocol, opts.device_name, opts.master_server_address)
        if rc in RPC_FAILURES or rc == -1:
            raise StoreUnreachable(f"mooncake setup against master {opts.master_server_address} returned {rc}")
        if rc != 0:  # e.g. -600, invalid parameters: a global_segment_size under 16 MB is refused
            raise StoreError(f"mooncake setup refused these settings (code {rc}; global_segment_size must be "
                             "at least 16mb)")

    @staticmethod
    def _check(op: str, rc: int) -> None:
        if rc in RPC_FAILURES:
            raise StoreUnreachable(f"mooncake {op}: the master did not answer (code {rc})")
        if rc != 0:
            raise StoreError(f"mooncake {op} returned {rc}")

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            values = self._store.get_batch(list(keys))
        if len(values) != len(keys):
            raise StoreError(f"mooncake get returned {len(values)} entries for {len(keys)} keys")
        return [v or None for v in values]  # b"" is absent (or lost in transfer)

    def put(self, items: Sequence[tuple[str, bytes]], overwrite: bool = False) -> None:
        if not items:
            return
        keys, values = [k for k, _ in items], [v for _, v in items]
        with self._lock:
            rc = (self._store.upsert_batch if overwrite else self._store.put_batch)(keys, values)
        self._check("upsert" if overwrite else "put", rc)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        with self._lock:
            codes = self._store.batch_is_exist(list(keys))
        if any(rc < 0 for rc in codes):  # -1: a lookup only fails when the master cannot answer
            raise StoreUnreachable(f"mooncake lookup failed (code {min(codes)})")
        return [rc == 1 for rc in codes]

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:  # a leased entry (read in the last seconds) refuses removal: the overwrite replaces it
            with self._lock:
                rc = self._store.remove(key)
            if rc in RPC_FAILURES:
                self._check("remove", rc)

    def close(self) -> None:
        with self._lock:
            self._store.close()
