"""Policies end to end: power_of_two follows the workers' /get_load; cache_aware keeps a prefix
on the worker that holds it, spreads texts nobody holds, and counts load until a stream ends."""
from __future__ import annotations

import threading

import httpx
from harness import Cluster

from tests.helpers import wait_until


def test_power_of_two_avoids_the_worker_reporting_load(cluster: Cluster) -> None:
    busy, idle = cluster.worker(name="busy"), cluster.worker(name="idle")
    busy.control(load={"running": 40, "queued": 10})
    r = cluster.router("--worker-urls", busy.url, idle.url, "--policy", "power_of_two",
                       "--load-poll-interval-secs", "0.1")
    wait_until(lambda: any(w["reported_load"] == 50 for w in httpx.get(f"{r.url}/workers").json()["workers"]),
               what="load polled")
    served = [httpx.post(f"{r.url}/generate", json={"text": str(i)}).json()["worker"] for i in range(12)]
    assert served == ["idle"] * 12
    busy.control(load={"running": 0, "queued": 0})
    idle.control(load={"running": 30, "queued": 0})
    wait_until(lambda: httpx.post(f"{r.url}/generate", json={"text": "again"}).json()["worker"] == "busy",
               what="choice follows the reports")


def test_cache_aware_affinity_and_spreading(cluster: Cluster) -> None:
    ws = [cluster.worker(name=f"w{i}") for i in range(3)]
    r = cluster.router("--worker-urls", *[w.url for w in ws], "--policy", "cache_aware")
    systems = [f"SYSTEM PROMPT {k}: " + "you are a careful assistant. " * 8 for k in range(6)]
    owner: dict[int, str] = {}
    for rnd in range(4):
        for k, s in enumerate(systems):
            who = httpx.post(f"{r.url}/v1/completions", json={"prompt": s + f"question {rnd}"}).json()["worker"]
            assert owner.setdefault(k, who) == who, f"prompt {k} moved from {owner[k]} to {who}"
    # Six new prefixes arriving one by one at equal load went round the workers.
    assert sorted(owner.values()) == ["w0", "w0", "w1", "w1", "w2", "w2"]
    m = httpx.get(f"{r.url}/metrics").text
    assert 'splitserve_router_prefix_match_ratio_bucket{le="1"} 24' in m
    assert 'splitserve_router_prefix_match_ratio_bucket{le="0.8"} 6' in m, "only the first of each prefix missed"


def test_cache_aware_counts_a_stream_as_load_until_it_ends(cluster: Cluster) -> None:
    a, b = cluster.worker(name="a"), cluster.worker(name="b")
    a.control(hold_after_first_chunk=True)
    b.control(hold_after_first_chunk=True)
    r = cluster.router("--worker-urls", a.url, b.url, "--policy", "cache_aware",
                       "--balance-abs-threshold", "0", "--balance-rel-threshold", "1.0")
    prefix = "shared prefix " * 20
    threads = []
    for i in range(2):
        t = threading.Thread(target=lambda i=i: httpx.post(f"{r.url}/generate", json={"text": prefix + str(i), "stream": True}, timeout=30))
        t.start()
        threads.append(t)
        wait_until(lambda i=i: len(a.requests()) + len(b.requests()) == i + 1, what="stream started")
    load = {w["url"]: w["load"] for w in httpx.get(f"{r.url}/workers").json()["workers"]}
    # The first open stream counted as load, so the second (same prefix) went to the idle worker.
    assert load == {a.url: 1, b.url: 1}
    a.release()
    b.release()
    for t in threads:
        t.join(10)
    wait_until(lambda: all(w["load"] == 0 for w in httpx.get(f"{r.url}/workers").json()["workers"]), what="load back to 0")
