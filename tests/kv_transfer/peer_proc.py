"""A prefill or decode peer in its own process, driven by JSON lines on stdin (see kv_harness.py).

It owns a KV-shaped pool filled with random bytes from --seed (decode pools live in a
SharedSegment for shm/auto) and a transfer manager; each command gets exactly one JSON reply line.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any

import numpy as np

from kv_transfer import (
    AuxLayout, DecodeTransferManager, KVLayout, KVTransferError, PrefillTransferManager, SharedSegment,
    TransferConfig,
)

AUX_SLOTS = 16


class Pool:
    def __init__(self, args: argparse.Namespace, shared: bool) -> None:
        shape = dict(num_layers=args.layers, num_pages=args.pages, page_size=args.page_size,
                     num_kv_heads=args.heads, head_dim=args.dim, dtype=args.dtype)
        self.kv_bytes = KVLayout.pool_bytes(**shape)
        total = self.kv_bytes + AUX_SLOTS * 32
        self.segment = SharedSegment.create(total) if shared else None
        if self.segment is not None:
            self.bytes = np.frombuffer(self.segment.buffer, dtype=np.uint8)
        else:
            self.bytes = np.zeros(total, dtype=np.uint8)
        self.bytes[: self.kv_bytes] = np.random.default_rng(args.seed).integers(0, 256, self.kv_bytes, dtype=np.uint8)
        base = int(self.bytes.ctypes.data)
        self.layout = KVLayout.packed(base, **shape)
        self.aux = AuxLayout(base + self.kv_bytes, AUX_SLOTS)
        for slot in range(AUX_SLOTS):
            self.aux.clear(slot)

    def page_checksum(self, page: int) -> str:
        h = hashlib.blake2b(digest_size=16)
        base0 = int(self.bytes.ctypes.data)
        pb = self.layout.page_bytes
        for addr in self.layout.bases():
            off = addr - base0 + page * self.layout.stride
            h.update(self.bytes[off: off + pb].tobytes())
        return h.hexdigest()


def _room_info(obj: Any) -> dict[str, Any]:
    failure = obj.failure
    info = {"state": obj.poll().name, "kind": failure.kind.value if failure else None,
            "reason": failure.message if failure else None,
            "error": type(failure.error).__name__ if failure and failure.error else None}
    record = getattr(obj, "aux_record", None)
    if record is not None:
        info["aux"] = [record.first_token_id, record.cached_tokens, record.room]
    return info


def _wait(obj: Any, states: list[str], timeout: float) -> dict[str, Any]:
    start = time.monotonic()
    while time.monotonic() - start < timeout and obj.poll().name not in states:
        time.sleep(0.005)
    return {**_room_info(obj), "elapsed": time.monotonic() - start}


def handle(cmd: dict[str, Any], role: str, pool: Pool, mgr: Any) -> dict[str, Any]:
    op = cmd["cmd"]
    if op == "checksums":
        return {"sums": [pool.page_checksum(p) for p in cmd["pages"]]}
    if op == "metrics":
        snap = mgr.metrics.snapshot()
        return {**snap, "rooms_by_state": {s.name: n for s, n in mgr.rooms_by_state().items()}}
    if op == "connect":
        return {"transport": mgr.connect("127.0.0.1", cmd["port"])}
    if op == "recv":
        r = mgr.create_receiver(cmd["room"], "127.0.0.1", cmd["port"])
        if cmd.get("pages") is not None:
            r.init(cmd["pages"], cmd.get("aux_slot", 0), cmd.get("held", 0))
        return _room_info(r)
    if op == "init":
        r = mgr.receiver(cmd["room"])
        r.init(cmd["pages"], cmd.get("aux_slot", 0), cmd.get("held", 0))
        return _room_info(r)
    if op == "sender":
        return _room_info(mgr.create_sender(cmd["room"]))
    room = mgr.sender(cmd["room"]) if role == "prefill" else mgr.receiver(cmd["room"])
    if op == "state":
        return _room_info(room)
    if op == "wait":
        return _wait(room, cmd["states"], cmd["timeout"])
    if op == "dst":
        return {"dst": list(room.dst_pages or ()), "held": room.held_prefix_tokens}
    if op == "send":
        queued = room.send(cmd["pages"], last=cmd.get("last", False), first_token_id=cmd.get("first_token"),
                           cached_tokens=cmd.get("cached", 0))
        return {"queued": queued, **_room_info(room)}
    if op == "abort":
        room.abort(cmd["reason"])
        return _room_info(room)
    if op == "release":
        room.release()
        return {"released": True}
    raise ValueError(f"unknown command {op}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--config", default="{}", help="TransferConfig fields as JSON")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="")
    args = ap.parse_args()
    config = TransferConfig(**json.loads(args.config))
    shared = args.role == "decode" and config.backend in ("shm", "auto")
    pool = Pool(args, shared)
    name = args.name or args.role
    if args.role == "prefill":
        mgr: Any = PrefillTransferManager(config, pool.layout, bootstrap_port=0, bootstrap_host="127.0.0.1",
                                          worker_id=name)
        ready = {"ready": True, "port": mgr.port}
    else:
        mgr = DecodeTransferManager(config, pool.layout, pool.aux, worker_id=name,
                                    segments=[pool.segment] if pool.segment else [])
        ready = {"ready": True}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        try:
            reply = handle(cmd, args.role, pool, mgr)
        except KVTransferError as exc:
            reply = {"exc": type(exc).__name__, "message": str(exc), "field": getattr(exc, "field", None),
                     "local": str(getattr(exc, "local", "")), "remote": str(getattr(exc, "remote", ""))}
        print(json.dumps(reply), flush=True)
    mgr.close()
    if pool.segment is not None:
        pool.segment.close()


if __name__ == "__main__":
    main()
