"""The decode worker's own settings (the engine's and kv_transfer's come from their config dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DecodeConfig:
    decode_reserve_tokens: int = field(default=256, metadata={
        "help": "output tokens of headroom kept free for every reserved or running request before another "
                "request's pages are reserved (admission waits rather than over-commit)"})
    max_transfer_rooms: int = field(default=256, metadata={
        "help": "requests that may have pages reserved and KV arriving at once (further ones queue)"})
    kv_quarantine: float = field(default=5.0, metadata={
        "help": "seconds the pages of a failed or aborted transfer stay out of use, so a late write from a "
                "stalled prefill worker cannot land in pages given to another request"})
    prefill_allow: tuple[str, ...] = field(default=("loopback", "private"), metadata={
        "help": "prefill bootstrap addresses this worker may dial: '*', 'loopback', 'private', networks "
                "(10.2.0.0/16), addresses or host names, each optionally :PORT (decode_worker/allow.py)"})
    worker_id: str | None = field(default=None, metadata={
        "help": "name in logs and in the handshake (default: decode-HOST:PORT)"})
