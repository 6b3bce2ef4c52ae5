"""A prefill and a decode manager in this process (fake or shm backend), for in-process tests."""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from kv_transfer import (
    AuxBuffer, DecodeTransferManager, KVLayout, PrefillTransferManager, TransferConfig, TransferMetrics,
)
from kv_harness import FAST

SHAPE = dict(num_layers=4, num_pages=64, page_size=4, num_kv_heads=2, head_dim=16, dtype="float32")


class LocalPool:
    def __init__(self, seed: int, shape: dict[str, Any]) -> None:
        nbytes = KVLayout.pool_bytes(**shape)
        self.bytes = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        self.layout = KVLayout.packed(int(self.bytes.ctypes.data), **shape)

    def checksums(self, pages: list[int]) -> list[str]:
        out = []
        base0, pb = int(self.bytes.ctypes.data), self.layout.page_bytes
        for p in pages:
            h = hashlib.blake2b(digest_size=16)
            for addr in self.layout.bases():
                off = addr - base0 + p * self.layout.stride
                h.update(self.bytes[off: off + pb].tobytes())
            out.append(h.hexdigest())
        return out


class InProcPair:
    def __init__(self, backend: str = "fake", prefill_shape: dict[str, Any] | None = None,
                 decode_shape: dict[str, Any] | None = None, prefill_metrics: TransferMetrics | None = None,
                 **config: Any) -> None:
        self.config = TransferConfig(**{**FAST, "backend": backend, **config})
        self.src = LocalPool(1, prefill_shape or SHAPE)
        self.dst = LocalPool(2, decode_shape or SHAPE)
        self.aux = AuxBuffer(16)
        self.prefill = PrefillTransferManager(self.config, self.src.layout, bootstrap_port=0,
                                              bootstrap_host="127.0.0.1", worker_id="prefill-test",
                                              metrics=prefill_metrics)
        self.decode = DecodeTransferManager(self.config, self.dst.layout, self.aux.layout, worker_id="decode-test")
        self.port = self.prefill.port

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
