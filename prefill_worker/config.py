"""The prefill worker's own settings (the engine's and kv_transfer's come from their config dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PrefillConfig:
    bootstrap_port: int = field(default=8998, metadata={
        "help": "port of the bootstrap (handshake) gRPC server decode workers connect to"})
    bootstrap_host: str | None = field(default=None, metadata={
        "help": "address the bootstrap server listens on (decode workers must reach it; default: --host)"})
    worker_id: str | None = field(default=None, metadata={
        "help": "name in logs and in the handshake (default: prefill-HOST:PORT)"})
