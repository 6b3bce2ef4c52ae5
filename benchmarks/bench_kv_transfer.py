"""KV transfer throughput: each backend against a plain socket and a memcpy measured in the same run.

A realistic layout (32 layers, 8 KV heads, head dim 128, page size 16, bfloat16: 32 KiB per page per K/V
buffer, 2 MiB per page over all layers) moves TOTAL bytes of pages from this process (prefill side) into
a decode process, contiguous (pages i..i+n into j..j+n) and scattered (random pages into random pages).
Time runs from send() to the sender's Success, i.e. includes the aux record and the status report.
Baselines: a TCP loopback socket between two processes (1 MiB sendall/recv_into), and numpy memcpy.
Goals from the issue: mooncake (tcp) >= 0.35x socket; shm >= 0.5x memcpy. `mooncake-unstaged` is Mooncake
with staging slots turned off (every page of a scattered set is its own entry), for comparison.

    python benchmarks/bench_kv_transfer.py             # 64 MiB per transfer (fast)
    python benchmarks/bench_kv_transfer.py --full      # 256 MiB per transfer
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv_transfer import (  # noqa: E402
    AuxLayout, DecodeTransferManager, KVLayout, PrefillTransferManager, RoomState, SharedSegment, TransferConfig,
)

SHAPE = dict(num_layers=32, page_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
PAGE_ALL_LAYERS = 2 * 32 * 16 * 8 * 128 * 2  # bytes of one page over all layers, K and V
CHUNK = 1 << 20
GOALS = {"mooncake": ("socket", 0.35), "shm": ("memcpy", 0.5)}


def _config(name: str) -> TransferConfig:
    """`name` is a backend, or `mooncake-unstaged`: Mooncake writing every page directly (no staging slots)."""
    backend, _, variant = name.partition("-")
    extra = {"staging_slot_bytes": 0} if variant == "unstaged" else {}
    return TransferConfig(backend=backend, hostname="127.0.0.1", transfer_timeout=60.0, waiting_timeout=60.0,
                          **extra)


# --- child processes ---------------------------------------------------------------------------------
def decode_child(backend: str, num_pages: int) -> None:
    kv_bytes = KVLayout.pool_bytes(num_pages=num_pages, **SHAPE)
    total = kv_bytes + 64 * 32
    seg = SharedSegment.create(total) if backend == "shm" else None
    buf = np.frombuffer(seg.buffer, dtype=np.uint8) if seg else np.zeros(total, dtype=np.uint8)
    buf[:] = 0  # touch every page, as an engine's pool is, so page faults are not timed
    base = int(buf.ctypes.data)
    manager = DecodeTransferManager(_config(backend), KVLayout.packed(base, num_pages=num_pages, **SHAPE),
                                    AuxLayout(base + kv_bytes, 64), worker_id="bench-decode",
                                    segments=[seg] if seg else [])
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        receiver = manager.create_receiver(cmd["room"], "127.0.0.1", cmd["port"])
        receiver.init(cmd["pages"], aux_slot=cmd["room"] % 64)
        print("ok", flush=True)
    manager.close()
    if seg is not None:
        del buf
        seg.close()


def socket_child(port: int, total: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        for _ in range(int(os.environ.get("BENCH_REPEAT", "1"))):
            got = 0
            while got < total:
                n = conn.recv_into(view, min(CHUNK, total - got))
                if n == 0:
                    return
                got += n
            conn.sendall(b"k")


# --- measurements --------------------------------------------------------------------------------------
def measure_memcpy(total: int, repeat: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros_like(src)
    dst[:] = 1  # fault the pages in before timing
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return total / statistics.median(times) / 1e9


def measure_socket(total: int, repeat: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    view = memoryview(src)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        child = subprocess.Popen([sys.executable, __file__, "--child", "socket", "--port",
                                  str(server.getsockname()[1]), "--bytes", str(total)],
                                 env={**os.environ, "BENCH_REPEAT": str(repeat)})
        conn, _ = server.accept()
        times = []
        with conn:
            for _ in range(repeat):
                t = time.perf_counter()
                for off in range(0, total, CHUNK):
                    conn.sendall(view[off:off + CHUNK])
                if conn.recv(1) != b"k":
                    raise RuntimeError("socket baseline: receiver went away")
                times.append(time.perf_counter() - t)
        child.wait(timeout=60)
    return total / statistics.median(times) / 1e9


def page_sets(pattern: str, n: int, pool: int, rng: random.Random) -> tuple[list[int], list[int]]:
    if pattern == "contiguous":
        s, d = rng.randrange(0, pool - n), rng.randrange(0, pool - n)
        return list(range(s, s + n)), list(range(d, d + n))
    return rng.sample(range(pool), n), rng.sample(range(pool), n)


def measure_backend(backend: str, pages: int, repeat: int) -> dict[str, float]:
    pool = pages * 3
    src = np.random.default_rng(1).integers(0, 256, KVLayout.pool_bytes(num_pages=pool, **SHAPE), dtype=np.uint8)
    prefill = PrefillTransferManager(_config(backend), KVLayout.packed(int(src.ctypes.data), num_pages=pool,
                                                                      **SHAPE),
                                     bootstrap_port=0, bootstrap_host="127.0.0.1", worker_id="bench-prefill")
    child = subprocess.Popen([sys.executable, __file__, "--child", "decode", "--backend", backend,
                              "--pages", str(pool)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin and child.stdout
    results: dict[str, float] = {}
    try:
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("decode child failed to start")

        def open_receiver(room: int, d_pages: list[int]) -> None:
            assert child.stdin and child.stdout
            child.stdin.write(json.dumps({"op": "recv", "room": room, "port": prefill.port, "pages": d_pages}) + "\n")
            child.stdin.flush()
            child.stdout.readline()

        results = run_rooms(prefill, open_receiver, pages, pool, repeat)
        child.stdin.write(json.dumps({"op": "exit"}) + "\n")
        child.stdin.flush()
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
        prefill.close()
    return results


def run_rooms(prefill: PrefillTransferManager, open_receiver: Callable[[int, list[int]], None], pages: int,
              pool: int, repeat: int) -> dict[str, float]:
    """GB/s per pattern: median over `repeat` rooms after warm-up rooms, send() to the sender's Success."""
    results: dict[str, float] = {}
    rng, room = random.Random(5), 1
    # Warm-up: every page once, so mappings are faulted in as in a serving worker whose pool is in use
    # (the memcpy baseline pre-faults its buffers too).
    open_receiver(room, list(range(pool)))
    sender = prefill.create_sender(room)
    _wait(sender, RoomState.WAITING_FOR_INPUT)
    sender.send(list(range(pool)), last=True, first_token_id=1)
    _wait(sender, RoomState.SUCCESS)
    sender.release()
    room += 1
    for pattern in ("contiguous", "scattered"):
        times = []
        for _ in range(repeat + 1):
            s_pages, d_pages = page_sets(pattern, pages, pool, rng)
            open_receiver(room, d_pages)
            sender = prefill.create_sender(room)
            _wait(sender, RoomState.WAITING_FOR_INPUT)
            t = time.perf_counter()
            sender.send(s_pages, last=True, first_token_id=1)
            _wait(sender, RoomState.SUCCESS)
            times.append(time.perf_counter() - t)
            sender.release()
            room += 1
        results[pattern] = pages * PAGE_ALL_LAYERS / statistics.median(times[1:]) / 1e9
    return results


def _wait(sender: Any, state: RoomState, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while sender.poll() != state:
        if sender.poll() == RoomState.FAILED:
            raise RuntimeError(f"room failed: {sender.failure_reason}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"room stuck in {sender.poll().name}")
        time.sleep(0.002)  # a worker polls about once per scheduler step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=64, help="bytes of pages per transfer (default 64 MiB)")
    ap.add_argument("--full", action="store_true", help="256 MiB per transfer, as in the issue")
    ap.add_argument("--repeat", type=int, default=3, help="timed transfers per case (median reported)")
    ap.add_argument("--backends", default="mooncake,mooncake-unstaged,shm,fake",
                    help="mooncake-unstaged = Mooncake without staging slots (every page its own entry)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", choices=("decode", "socket"), help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--pages", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    if args.child == "decode":
        return decode_child(args.backend, args.pages)
    if args.child == "socket":
        return socket_child(args.port, args.bytes)

    total = (256 if args.full else args.total_mib) << 20
    pages = total // PAGE_ALL_LAYERS
    total = pages * PAGE_ALL_LAYERS
    base = {"memcpy": measure_memcpy(total, args.repeat), "socket": measure_socket(total, args.repeat)}
    rows = [("memcpy (baseline)", "-", base["memcpy"], "", ""), ("plain TCP socket (baseline)", "-", base["socket"], "", "")]
    report: dict[str, Any] = {"total_bytes": total, "pages": pages, "baselines": base, "backends": {}}
    for backend in args.backends.split(","):
        got = measure_fake(pages, args.repeat) if backend == "fake" else measure_backend(backend, pages, args.repeat)
        report["backends"][backend] = got
        ref, goal = GOALS.get(backend, ("socket", 0.0) if backend.startswith("mooncake") else ("memcpy", 0.0))
        for pattern, gbps in got.items():
            ratio = gbps / base[ref]
            verdict = ("yes" if ratio >= goal else "NO") if backend in GOALS else ""
            rows.append((backend, pattern, gbps, f"{ratio:.2f}x {ref}", verdict + (f" (>= {goal}x)" if goal else "")))
    print(f"\nKV transfer, {total >> 20} MiB per transfer ({pages} pages x {PAGE_ALL_LAYERS >> 20} MiB), "
          f"median of {args.repeat}\n")
    print("| path | pattern | GB/s | ratio | goal met |\n| --- | --- | --- | --- | --- |")
    for name, pattern, gbps, ratio, verdict in rows:
        print(f"| {name} | {pattern} | {gbps:.2f} | {ratio} | {verdict} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def measure_fake(pages: int, repeat: int) -> dict[str, float]:
    """The fake backend is in-process: both managers here, so this is memcpy through the full stack."""
    pool = pages * 3
    config = _config("fake")
    nbytes = KVLayout.pool_bytes(num_pages=pool, **SHAPE)
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty(nbytes + 64 * 32, dtype=np.uint8)
    dst[:] = 0  # fault the pages in before timing
    prefill = PrefillTransferManager(config, KVLayout.packed(int(src.ctypes.data), num_pages=pool, **SHAPE),
                                     bootstrap_port=0, bootstrap_host="127.0.0.1")
    decode = DecodeTransferManager(config, KVLayout.packed(int(dst.ctypes.data), num_pages=pool, **SHAPE),
                                   AuxLayout(int(dst.ctypes.data) + nbytes, 64))
    try:
        results = run_rooms(prefill, lambda room, d_pages: decode.create_receiver(
            room, "127.0.0.1", prefill.port).init(d_pages, aux_slot=room % 64), pages, pool, repeat)
    finally:
        decode.close()
        prefill.close()
    return results


if __name__ == "__main__":
    main()
