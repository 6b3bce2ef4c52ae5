"""Does a burst of huge prompts stall the server's other work? A colocated server streams one completion while
ten multi-megabyte prompts arrive at once (each refused: far over the context); meanwhile /health is polled.
Reports the stream's median inter-chunk gap before the burst, its worst gap during it, and the slowest /health
answer, for the working tree and for a base revision (a git worktree), interleaved round by round.

Before (tokenizing on the event loop), each 5 MB prompt held the loop for seconds; after, a prompt that cannot
fit is refused from its length alone (``Tokenizer.fewest_tokens``) and long texts are tokenized on a thread
(since then, on one thread for huge texts: ``engine/server/text_pool.py``). The burst is sent by a separate
process that encodes its body before it starts (see ``burst``). A third side, the control, streams from the new
server while the same burst goes to a process that only reads the bodies and answers 400 (``sink``): what is
left of the gap there is the host's, not the server's.

    python -m benchmarks.bench_event_loop --base REV [--rounds 2] [--mib 5 1] [--model smollm2|tiny]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import Process, model_dir

ROOT = Path(__file__).resolve().parents[1]


def send_burst(url: str, mib: float, count: int, ready, go, results) -> None:  # noqa: ANN001 - mp objects
    """In a child process: encode one body, then on ``go`` post it ``count`` times at once; put the statuses."""
    body = json.dumps({"prompt": "word " * int(mib * (1 << 20) / 5), "max_tokens": 1}).encode()
    statuses: list[int | str] = []

    def big() -> None:
        try:
            statuses.append(httpx.post(url + "/v1/completions", content=body, timeout=300,
                                       headers={"content-type": "application/json"}).status_code)
        except httpx.HTTPError as e:
            statuses.append(f"{type(e).__name__}")
    ready.set()
    if not go.wait(300):
        return  # the parent gave up
    senders = [threading.Thread(target=big) for _ in range(count)]
    for s in senders:
        s.start()
    for s in senders:
        s.join()
    results.put(statuses)


def sink(port: int) -> None:
    """In a child process, the control: an HTTP endpoint that only reads each request's body (Content-Length)
    and answers 400, doing as little as a server can. A burst aimed at it shows what the burst alone costs the
    host (the sender, loopback, a reader), whatever the server does with the bodies."""
    def handle(conn: socket.socket) -> None:
        with conn:
            buf = b""
            while b"\r\n\r\n" not in buf:
                if not (data := conn.recv(1 << 16)):
                    return
                buf += data
            head, _, rest = buf.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            got = len(rest)
            while got < length and (data := conn.recv(1 << 20)):
                got += len(data)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
    srv = socket.create_server(("127.0.0.1", port), backlog=64)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def burst(url: str, mib: float, count: int, burst_url: str | None = None) -> dict:
    """One measurement: a stream, a burst of `count` prompts of `mib` MiB (to ``burst_url``, else to the same
    server), /health polled throughout."""
    chunks: list[float] = []
    health: list[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 160, "ignore_eos": True, "stream": True,
                "temperature": 0}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(time.monotonic())
        finally:
            done.set()

    def poll() -> None:
        while not done.is_set():
            t = time.monotonic()
            httpx.get(url + "/health", timeout=60)
            health.append(time.monotonic() - t)
            time.sleep(0.1)

    # The burst comes from its own process, its bodies encoded before it starts: the client shares the server's
    # two cores, and in one process its senders' GIL would delay the stream reader, so gaps would be the client's.
    mp = multiprocessing.get_context("spawn")
    ready, go, results = mp.Event(), mp.Event(), mp.Queue()
    sender = mp.Process(target=send_burst, args=(burst_url or url, mib, count, ready, go, results), daemon=True)
    sender.start()
    try:
        deadline = time.monotonic() + 120
        while not ready.wait(0.5):
            if not sender.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the burst's sender did not start (exit code {sender.exitcode})")
        workers = [threading.Thread(target=f) for f in (stream, poll)]
        for w in workers:
            w.start()
        while len(chunks) < 20 and not done.is_set():
            time.sleep(0.01)
        start = time.monotonic()
        go.set()
        statuses = results.get(timeout=300)
        end = time.monotonic()
        for w in workers:
            w.join(300)
    finally:
        done.set()
        sender.join(30)
        if sender.is_alive():
            sender.terminate()
    if len(statuses) != count or any(not isinstance(x, int) for x in statuses):
        raise RuntimeError(f"the burst's posts did not all get an answer: {statuses}")
    gaps = [b - a for a, b in zip(chunks, chunks[1:])]
    before = [g for g, t in zip(gaps, chunks[1:]) if t < start]
    during = [g for g, t in zip(gaps, chunks[1:]) if start <= t <= end + 0.5] or [0.0]
    return {"median_gap_ms": 1000 * statistics.median(before), "worst_gap_ms": 1000 * max(during),
            "slowest_health_ms": 1000 * max(health), "burst_s": end - start, "statuses": sorted(set(statuses))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare against (checked out in a worktree)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mib", type=float, nargs="+", default=[5.0, 1.0], help="prompt sizes to burst with")
    ap.add_argument("--count", type=int, default=10, help="prompts per burst")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()
    model = str(model_dir(args.model))
    tmp = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    base = tmp / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", str(base), args.base], check=True)
    for so in (ROOT / "router").glob("_router*.so"):
        shutil.copy(so, base / "router")
    rows = []
    sink_port = Process.free_port()
    control = multiprocessing.get_context("spawn").Process(target=sink, args=(sink_port,), daemon=True)
    control.start()
    try:
        for rnd in range(args.rounds):
            # control: the new server streams while the burst goes to the sink, not to it
            for side, tree in (("base", base), ("new", ROOT), ("control", ROOT)):
                srv = Process("engine", ["--model-path", model], cwd=tree)
                try:
                    srv.wait_ready("/health")
                    for mib in args.mib:
                        target = f"http://127.0.0.1:{sink_port}" if side == "control" else None
                        r = {"round": rnd, "side": side, "mib": mib, **burst(srv.url, mib, args.count, target)}
                        rows.append(r)
                        print(json.dumps(r), flush=True)
                finally:
                    srv.stop()
    finally:
        control.terminate()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    print(f"\n{'side':7} {'MiB':>4} {'median gap ms':>14} {'worst gap ms (max, median of rounds)':>37} "
          f"{'slowest /health ms':>19}")
    for side in ("base", "new", "control"):
        for mib in args.mib:
            sel = [r for r in rows if r["side"] == side and r["mib"] == mib]
            print(f"{side:7} {mib:4g} {statistics.median(r['median_gap_ms'] for r in sel):14.1f} "
                  f"{max(r['worst_gap_ms'] for r in sel):24.1f} "
                  f"{statistics.median(r['worst_gap_ms'] for r in sel):12.1f} "
                  f"{max(r['slowest_health_ms'] for r in sel):19.1f}")
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
