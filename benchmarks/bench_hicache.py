"""HiCache on a multi-tenant workload: ``--tenants`` tenants, each with a ``--system-tokens`` system prompt and
short distinct questions, asked round-robin for ``--rounds`` rounds, so each tenant's prompt recurs only after
the device pool (sized for ``--l1-tenants`` tenants) has cycled. Same run, one server per configuration, the
requests alternating between them one at a time (no two servers compute at once): the radix cache alone (L1),
L1 + a host tier (L2) holding every tenant, under write_through and write_back, and L1 + L2 + a shared store
(L3: the file store, and a Mooncake Store with its master started here). Then, per store, a second worker: a
fresh server on the same store asks every tenant once more (a new question), so its prefixes come only from
what the first worker stored; its TTFT is compared with the cold
TTFT of the first round (the prefix computed).

Reported per configuration: TTFT p50/p99 of the recurring rounds (streamed /v1/completions, time to the first
token), requests/s over the whole run, prompt tokens actually computed (prompt minus cached), and hit tokens by
tier (host hits from ``splitserve_hicache_loaded_tokens``; device hits are the rest of the cached tokens).

    python -m benchmarks.bench_hicache --model smollm2 --tenants 40 --system-tokens 2000 --l1-tenants 10
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import Process, machine, metric_total, model_dir, table, write_json
from deploy.mooncake_master import MooncakeMaster

QUESTION, OUTPUT = 16, 8


def ttft(client: httpx.Client, model: str, ids: list[int]) -> float:
    """Seconds from sending the request to its first streamed token."""
    body = {"model": model, "prompt": ids, "max_tokens": OUTPUT, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    first = None
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"]:
                    first = time.perf_counter() - start
    assert first is not None, "no token streamed"
    return first


def wait_store_up(url: str, timeout: float = 180.0) -> None:
    """Until the server's HiCache store is connected (a Mooncake client can take a while to mount its segment)."""
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/get_server_info", timeout=10).json()["hicache"]["store_state"] != "up":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: the HiCache store did not come up within {timeout:.0f} s")
        time.sleep(0.5)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tenants", type=int, default=40)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--l1-tenants", type=float, default=10.0, help="device pool size, in tenants' requests")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/hicache.json"))
    args = ap.parse_args()
    per_request = args.system_tokens + QUESTION + OUTPUT
    l1_tokens = int(args.l1_tenants * per_request)
    ratio = max(1.0, 1.25 * args.tenants * per_request / l1_tokens)  # L2 holds every tenant
    common = ["--model-path", str(model_dir(args.model)), "--dtype", args.dtype, "--max-total-tokens",
              str(l1_tokens), "--page-size", str(args.page_size)]
    configs = {"L1 (radix cache)": [],
               "L1+L2 write_through": ["--enable-hierarchical-cache", "--hicache-ratio", f"{ratio:.2f}"],
               "L1+L2 write_back": ["--enable-hierarchical-cache", "--hicache-ratio", f"{ratio:.2f}",
                                    "--hicache-write-policy", "write_back"]}
    store = Path(tempfile.mkdtemp(prefix="bench-hicache-store-"))
    l3 = ["--enable-hierarchical-cache", "--hicache-ratio", f"{ratio:.2f}", "--hicache-storage-backend", "file",
          "--hicache-storage-dir", str(store)]
    configs["L1+L2+L3 file"] = l3
    master = MooncakeMaster().start()
    l3m = ["--enable-hierarchical-cache", "--hicache-ratio", f"{ratio:.2f}", "--hicache-storage-backend", "mooncake",
           "--hicache-storage-backend-extra-config", master.extra_config(global_segment_size="8gb")]
    configs["L1+L2+L3 mooncake"] = l3m
    rng = random.Random(0)
    systems = [[rng.randrange(100, 49000) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    requests = [(r, s + [rng.randrange(100, 49000) for _ in range(QUESTION)])
                for r in range(args.rounds) for s in systems]
    servers = {name: Process("engine", [*common, *flags]) for name, flags in configs.items()}
    raw: dict[str, dict[str, Any]] = {name: {"ttft": [], "cold": [], "busy_s": 0.0} for name in configs}
    try:
        for srv in servers.values():
            srv.wait_ready("/health")
        clients = {name: httpx.Client(base_url=srv.url, timeout=600) for name, srv in servers.items()}
        model = clients["L1 (radix cache)"].get("/v1/models").json()["data"][0]["id"]
        for rnd, ids in requests:
            for name, client in clients.items():  # alternate: the same request to each, one at a time
                start = time.perf_counter()
                t = ttft(client, model, ids)
                raw[name]["busy_s"] += time.perf_counter() - start
                raw[name]["ttft" if rnd > 0 else "cold"].append(t)
        rows = []
        for name, srv in servers.items():
            prompt = metric_total(srv.url, "splitserve_prompt_tokens_total")
            cached = metric_total(srv.url, "splitserve_cached_prompt_tokens_total")
            host = metric_total(srv.url, "splitserve_hicache_loaded_tokens_total")
            from_store = metric_total(srv.url, "splitserve_hicache_store_loaded_tokens_total")
            rows.append({"config": name, "ttft_p50_s": statistics.median(raw[name]["ttft"]),
                         "ttft_p99_s": pct(raw[name]["ttft"], 0.99),
                         "first_round_ttft_p50_s": statistics.median(raw[name]["cold"]),
                         "req_per_s": len(requests) / raw[name]["busy_s"],
                         "prompt_tokens_computed": prompt - cached,
                         "device_hit_tokens": cached - host - from_store, "host_hit_tokens": host,
                         "store_hit_tokens": from_store})
        cold = statistics.median(raw["L1 (radix cache)"]["cold"])
        for name in [n for n in configs if n != "L1+L2+L3 mooncake"]:  # its memory is the Mooncake Store's
            servers[name].stop()  # at full size every server up at once needs more than 24 GB
        for backend, flags in (("file", l3), ("mooncake", l3m)):  # another worker on the same store
            name = f"second worker, L3 {backend} only"
            servers[name] = second = Process("engine", [*common, *flags])
            second.wait_ready("/health")
            wait_store_up(second.url)
            with httpx.Client(base_url=second.url, timeout=600) as client:
                again = [ttft(client, model, s + [rng.randrange(100, 49000) for _ in range(QUESTION)])
                         for s in systems]
            loaded = metric_total(second.url, "splitserve_hicache_store_loaded_tokens_total")
            rows.append({"config": name, "ttft_p50_s": statistics.median(again), "ttft_p99_s": pct(again, 0.99),
                         "store_hit_tokens": loaded, "ttft_p50_vs_cold": statistics.median(again) / cold})
            raw[name] = {"ttft": again}
    finally:
        for srv in servers.values():
            srv.stop()
        master.kill()
        shutil.rmtree(store, ignore_errors=True)
    for row in rows:
        row.setdefault("ttft_p50_vs_cold", row["ttft_p50_s"] / statistics.median(raw["L1 (radix cache)"]["cold"]))
    base = rows[0]
    for row in rows[:len(configs)]:
        row["ttft_p50_vs_L1"] = row["ttft_p50_s"] / base["ttft_p50_s"]
        row["throughput_vs_L1"] = row["req_per_s"] / base["req_per_s"]
    print(f"{args.tenants} tenants x {args.system_tokens}-token system prompts, {args.rounds} rounds; device pool "
          f"{l1_tokens} tokens ({args.l1_tenants} tenants), host tier {ratio:.2f}x that")
    print(table(rows, ["config", "ttft_p50_s", "ttft_p99_s", "ttft_p50_vs_L1", "ttft_p50_vs_cold",
                       "first_round_ttft_p50_s", "req_per_s",
                       "throughput_vs_L1", "prompt_tokens_computed", "device_hit_tokens", "host_hit_tokens",
                       "store_hit_tokens"]))
    write_json(args.out, {"machine": machine(), "args": vars(args) | {"out": str(args.out)}, "results": rows,
                          "raw": raw})


if __name__ == "__main__":
    main()
