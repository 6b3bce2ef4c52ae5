"""--max-duration ends a phase: requests in flight are cut and counted as 'deadline' errors, items not started
yet are 'not_sent'; the run returns promptly instead of waiting for a slow server."""
from __future__ import annotations

import time

import pytest

from benchmarks.bench_serving import main as bench_main


def test_slow_requests_are_cut_at_max_duration(fault_server, run_bench):
    srv = fault_server(ttft_ms=100, itl_ms=500)  # 40 tokens: 20 s per request
    t = time.monotonic()
    ph = run_bench(srv.url, "--num-prompts", "3", "--output-len", "40", "--input-len", "4", "--warmup-requests",
                   "0", "--max-duration", "1.5")["phases"][0]
    assert time.monotonic() - t < 15
    assert ph["hit_max_duration"] is True
    assert ph["errors"] == {"deadline": 3}
    assert ph["completed"] == 0 and ph["not_sent"] == 0
    assert all(r["ttft_s"] is not None for r in ph["requests"])  # they were streaming when cut
    assert 1.5 <= ph["duration_s"] < 5


def test_items_scheduled_after_the_deadline_are_not_sent(fault_server, run_bench):
    srv = fault_server()
    ph = run_bench(srv.url, "--num-prompts", "6", "--request-rate", "1", "--arrival", "constant", "--output-len",
                   "2", "--input-len", "4", "--warmup-requests", "0", "--max-duration", "1.5")["phases"][0]
    # items start at 0 s, 1 s, 2 s, ...: two fit in 1.5 s
    assert ph["completed"] == 2 and ph["not_sent"] == 4 and ph["failed"] == 0
    assert [r["start_s"] for r in ph["requests"] if r["ok"]] == pytest.approx([0.0, 1.0], abs=0.2)


@pytest.mark.parametrize("bad", [["--max-duration", "inf"], ["--max-duration", "0"], ["--num-prompts", "0"],
                                 ["--request-rate", "0"], ["--max-concurrency", "0"]])
def test_unbounded_or_empty_runs_are_refused(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(["--no-progress", *bad])
    assert exc.value.code == 2
    assert bad[0] in capsys.readouterr().err
