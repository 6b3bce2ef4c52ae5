"""Arrival schedules follow their rate and seed; --max-concurrency caps what the server sees in flight."""
from __future__ import annotations

import math

import httpx
import pytest

from benchmarks.serving.arrival import start_offsets
from benchmarks.serving.config import ConfigError


def test_poisson_gaps_have_the_requested_mean_and_follow_the_seed():
    a = start_offsets(4000, 20.0, "poisson", seed=1)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0 and all(g >= 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(1 / 20, rel=0.06)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert math.sqrt(var) / mean == pytest.approx(1.0, rel=0.1)  # exponential: coefficient of variation 1
    assert a == start_offsets(4000, 20.0, "poisson", seed=1)
    assert a != start_offsets(4000, 20.0, "poisson", seed=2)


def test_constant_burst_and_infinite_rates():
    assert start_offsets(4, 2.0, "constant", 0) == [0.0, 0.5, 1.0, 1.5]
    assert start_offsets(6, 4.0, "burst", 0, burst_size=3) == [0.0, 0.0, 0.0, 0.75, 0.75, 0.75]
    assert start_offsets(3, math.inf, "poisson", 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError):
        start_offsets(2, 1.0, "sometimes", 0)


def test_max_concurrency_caps_requests_in_flight(fault_server, run_bench):
    srv = fault_server(ttft_ms=150, itl_ms=10)
    ph = run_bench(srv.url, "--num-prompts", "8", "--max-concurrency", "3", "--request-rate", "inf",
                   "--input-len", "4", "--output-len", "2", "--warmup-requests", "0")["phases"][0]
    assert ph["completed"] == 8
    assert httpx.get(srv.url + "/stats").json()["max_in_flight"] == 3


def test_a_sweep_runs_one_phase_per_rate_and_concurrency(fault_server, run_bench):
    srv = fault_server(ttft_ms=5, itl_ms=5)
    res = run_bench(srv.url, "--num-prompts", "3", "--request-rate", "50", "inf", "--max-concurrency", "1", "2",
                    "--arrival", "constant", "--input-len", "4", "--output-len", "2", "--warmup-requests", "2")
    names = [p["name"] for p in res["phases"]]
    assert names == ["rate=50 conc=1", "rate=50 conc=2", "rate=inf conc=1", "rate=inf conc=2"]
    assert [p["request_rate"] for p in res["phases"]] == [50.0, 50.0, "inf", "inf"]
    assert all(p["completed"] == 3 for p in res["phases"])
    stats = httpx.get(srv.url + "/stats").json()
    assert stats["arrivals"] == 2 + 4 * 3  # warmup + every phase, nothing else
    assert stats["flushes"] == 4  # one cache flush before each phase
    assert [p["cache_flush"] for p in res["phases"]] == ["flushed"] * 4
    assert len(res["target"]["warmup"]) == 2 and all(w["ok"] for w in res["target"]["warmup"])
