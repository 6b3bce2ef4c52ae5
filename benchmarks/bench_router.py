"""Router benchmark: SplitServe's router against sglang-router and vllm-router, side by side
in one run, on the same stand-in worker processes (router/bench_worker, a fast Rust server).

Throughput: wrk (Debian's `wrk`, not Python-bound; HTTP/1.1 keep-alive, TCP_NODELAY on its
sockets) against each router pinned to CPU 0, the worker and wrk on CPU 1: requests/s, p50/p99
at concurrency 1, 32, 128 on /generate and /v1/completions; streamed requests/s at concurrency 1
and 32, events back to back and 200 µs apart; router CPU µs per request; resident memory. The bare worker (no router) is measured the same way as the ceiling.
Routing quality: 4 workers that simulate a prefix cache, a closed-loop client (concurrency 32)
sending many shared system prompts (64, ~1.8 kB) with distinct suffixes; share of prompt bytes served from
cache and max/min requests per worker, each router at its default cache_aware settings.

Set-up:  apt-get install wrk; python -m venv /work/venv-bench;
         /work/venv-bench/bin/pip install sglang-router==0.3.2 vllm-router   (or `pip install .[bench]`)
Run:     python benchmarks/bench_router.py --competitor-venv /work/venv-bench
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.process import free_ports, process_tree, tree_cpu_seconds

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    return free_ports(1)[0]


def wait_http(url: str, timeout: float = 60.0, method: str = "GET", body: bytes | None = None) -> None:
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not answering 200 within {timeout}s")


def rss_mib(pid: int) -> float:
    kb = 0
    for p in process_tree(pid):
        m = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{p}/status").read_text()) if Path(f"/proc/{p}/status").exists() else None
        kb += int(m.group(1)) if m else 0
    return kb / 1024


@dataclass
class Server:
    name: str
    popen: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        for p in reversed(process_tree(self.popen.pid)):
            try:
                os.kill(p, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def start(name: str, cmd: list[str], cpu: str, port: int, log_dir: Path, cwd: Path = ROOT) -> Server:
    log = (log_dir / f"{name}.log").open("wb")
    p = subprocess.Popen(["taskset", "-c", cpu, *cmd], stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    return Server(name, p, f"http://127.0.0.1:{port}")


def bench_worker_bin() -> Path:
    subprocess.run(["cargo", "build", "--release", "-j", "2", "-p", "splitserve-bench-worker"], cwd=ROOT, check=True)
    return ROOT / "target" / "release" / "splitserve-bench-worker"


EXTRA: dict[str, list[str]] = {}
BASELINE = "splitserve-baseline"
# Where each router is started from: the baseline is another checkout's `router` package.
CWD: dict[str, Path] = {}


def router_cmd(kind: str, port: int, urls: list[str], venv: Path) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware",
              *EXTRA.get(kind, [])]
    if kind in ("splitserve", BASELINE):
        return [sys.executable, "-m", "router.launch_router", *common, "--log-level", "warn"]
    if kind == "sglang-router":
        return [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    return [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]


# ---- throughput (wrk) ----------------------------------------------------------------------
def wrk(url: str, body: dict[str, Any], conns: int, secs: int, tmp: Path) -> dict[str, float]:
    script = tmp / "post.lua"
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      f"wrk.body = {json.dumps(json.dumps(body))}\n")
    out = subprocess.run(["taskset", "-c", "1", "wrk", "-t1", f"-c{conns}", f"-d{secs}s", "--latency", "-s", str(script), url],
                         capture_output=True, text=True, check=True).stdout

    def lat(pct: str) -> float:
        m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if not m:
            return float("nan")
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    total = re.search(r"(\d+) requests in", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errs = re.search(r"Socket errors: .*", out)
    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)), "p50_ms": lat("50"),
            "p99_ms": lat("99"), "requests": float(total.group(1)) if total else 0.0,
            "non2xx": float(bad.group(1)) if bad else 0.0, "socket_errors": errs.group(0) if errs else ""}


def throughput(kind: str, url: str, pid: int | None, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    gen = {"text": "The quick brown fox " * 8, "sampling_params": {"max_new_tokens": 8}}
    cmpl = {"model": "bench", "prompt": "The quick brown fox " * 8, "max_tokens": 8}
    wrk(f"{url}/generate", gen, 32, 2, tmp)  # warm-up
    rows: dict[str, Any] = {}
    for path, body in (("/generate", gen), ("/v1/completions", cmpl)):
        for c in args.concurrency:
            before = tree_cpu_seconds(pid) if pid else 0.0
            r = wrk(f"{url}{path}", body, c, args.duration, tmp)
            if pid and r["requests"]:
                r["cpu_us_per_req"] = (tree_cpu_seconds(pid) - before) * 1e6 / r["requests"]
            rows[f"{path} c={c}"] = r
            print(f"  {kind:14s} {path:16s} c={c:<4d} {r['rps']:9.0f} req/s  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms"
                  f"  non2xx {r['non2xx']:.0f}", flush=True)
    # Streams of 16 events: back to back (router cost per event), and 200 µs apart like tokens
    # (a router that leaves Nagle on stalls on the later events until the client's delayed ACK,
    # ~40 ms on Linux; on one keep-alive connection that shows on every response, at c=32 a busy
    # router mostly coalesces the events and it shows in the tail).
    for label, gap, conns in (("stream c=1", 0, 1), ("stream+gaps c=1", 200, 1),
                              ("stream c=32", 0, 32), ("stream+gaps c=32", 200, 32)):
        before = tree_cpu_seconds(pid) if pid else 0.0
        body = {**gen, "text": f"[gap_us={gap}] " + gen["text"], "stream": True}
        s = wrk(f"{url}/generate", body, conns, args.duration, tmp)
        if pid and s["requests"]:
            s["cpu_us_per_req"] = (tree_cpu_seconds(pid) - before) * 1e6 / s["requests"]
        rows[label] = s
        print(f"  {kind:14s} {label:22s} {s['rps']:9.0f} req/s  p50 {s['p50_ms']:.2f} ms  p99 {s['p99_ms']:.2f} ms", flush=True)
    if pid:
        rows["rss_mib"] = rss_mib(pid)
    return rows


# ---- routing quality ---------------------------------------------------------------------------
async def quality_load(url: str, n: int, conc: int, seed: int) -> None:
    import aiohttp
    rng = random.Random(seed)
    systems = [f"System prompt #{k}: you are agent {k}. " + " ".join(rng.choice("abcdefghij") * 5 for _ in range(300))
               for k in range(64)]
    jobs = [f"{systems[rng.randrange(64)]}\nUser {i}: please handle ticket {rng.randrange(10**9)} now." for i in range(n)]
    it = iter(jobs)
    async with aiohttp.ClientSession() as s:
        async def client() -> None:
            for prompt in it:
                async with s.post(f"{url}/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 8}}) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url} answered {r.status}")
        await asyncio.gather(*(client() for _ in range(conc)))


def quality(kind: str, args: argparse.Namespace, wbin: Path, log_dir: Path) -> dict[str, float]:
    import urllib.request
    ports = [free_port() for _ in range(4)]
    workers = [start(f"qworker-{kind}-{i}", [str(wbin), str(p), "--ns-per-uncached-byte", "1000", "--base-us", "500",
                                              "--threads", "1"], "1", p, log_dir) for i, p in enumerate(ports)]
    for w in workers:
        wait_http(f"{w.url}/health")
    rport = free_port()
    r = start(f"quality-{kind}", router_cmd(kind, rport, [w.url for w in workers], args.competitor_venv), "0", rport, log_dir,
              CWD.get(kind, ROOT))
    try:
        wait_http(f"{r.url}/generate", method="POST", body=b'{"text": "warm"}')
        asyncio.run(quality_load(r.url, args.quality_requests, 32, args.seed))
        stats = [json.load(urllib.request.urlopen(f"{w.url}/bench_stats")) for w in workers]
    finally:
        r.stop()
        for w in workers:
            w.stop()
    reqs = [s["requests"] for s in stats]
    hit = sum(s["cached_bytes"] for s in stats) / max(1, sum(s["prompt_bytes"] for s in stats))
    res = {"cache_hit_share": hit, "max_min_load": max(reqs) / max(1, min(reqs)), "requests_per_worker": reqs}
    print(f"  {kind:14s} hit share {hit:.3f}  max/min {res['max_min_load']:.3f}  per worker {reqs}", flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--competitor-venv", type=Path, default=Path(os.environ.get("ROUTER_BENCH_VENV", "/work/venv-bench")))
    p.add_argument("--routers", default="splitserve,sglang-router,vllm-router")
    p.add_argument("--baseline", type=Path, metavar="DIR",
                   help=f"also measure, as {BASELINE!r}, the SplitServe router of another checkout (DIR holds its "
                        "`router` package with the extension built), e.g. main before a change")
    p.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128])
    p.add_argument("--quality-requests", type=int, default=3000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--extra", action="append", default=[], metavar="ROUTER=ARGS",
                   help="extra flags for one router, e.g. --extra 'sglang-router=--balance-abs-threshold 4'")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "router.json")
    args = p.parse_args()
    kinds = [k for k in args.routers.split(",") if k]
    if args.baseline:
        kinds.insert(1, BASELINE)
        CWD[BASELINE] = args.baseline.resolve()
    for e in args.extra:
        k, _, v = e.partition("=")
        EXTRA[k] = v.split()
    wbin = bench_worker_bin()
    results: dict[str, Any] = {"throughput": {}, "quality": {}}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        print(f"logs in {tmp}", flush=True)
        wport = free_port()
        if args.skip_throughput:
            kinds_t: list[str] = []
        else:
            kinds_t = kinds
        worker = start("worker", [str(wbin), str(wport), "--chunks", "16", "--threads", "1"], "1", wport, tmp)
        wait_http(f"{worker.url}/health")
        try:
            if kinds_t:
                results["throughput"]["bare worker"] = throughput("bare worker", worker.url, None, args, tmp)
            for kind in kinds_t:
                rport = free_port()
                r = start(kind, router_cmd(kind, rport, [worker.url], args.competitor_venv), "0", rport, tmp,
                          CWD.get(kind, ROOT))
                try:
                    wait_http(f"{r.url}/generate", method="POST", body=b'{"text": "warm"}')
                    results["throughput"][kind] = throughput(kind, r.url, r.popen.pid, args, tmp)
                finally:
                    r.stop()
        finally:
            worker.stop()
        for kind in kinds:
            results["quality"][kind] = quality(kind, args, wbin, tmp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print_tables(results, kinds)
    return 0


def print_tables(res: dict[str, Any], kinds: list[str]) -> None:
    t = res["throughput"]
    if not t:
        t = {"bare worker": {}}
    cols = [k for k in t["bare worker"] if k != "rss_mib"]
    cpu_cols = ("/generate c=128", "stream c=32")
    print("\n| router | " + " | ".join(cols) + " | " + " | ".join(f"CPU µs/req ({c})" for c in cpu_cols) + " | RSS MiB |")
    print("|---" * (len(cols) + 2 + len(cpu_cols)) + "|")
    for name, rows in t.items():
        cells = [f"{rows[c]['rps']:.0f} ({rows[c]['p50_ms']:.2f}/{rows[c]['p99_ms']:.2f})" for c in cols]
        cpus = [rows.get(c, {}).get("cpu_us_per_req") for c in cpu_cols]
        cpu_cells = " | ".join("" if v is None else f"{v:.0f}" for v in cpus)
        print(f"| {name} | " + " | ".join(cells) + f" | {cpu_cells} | {rows.get('rss_mib', float('nan')):.0f} |")
    print("\ncells: requests/s (p50 ms / p99 ms)\n\n| router | cache hit share | max/min requests per worker |\n|---|---|---|")
    for k in kinds:
        q = res["quality"][k]
        print(f"| {k} | {q['cache_hit_share']:.3f} | {q['max_min_load']:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
