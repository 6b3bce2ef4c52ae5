"""Against a server that waits known times (TTFT 200 ms, then a token every 40 ms), the tool measures those
times. Tolerances: nothing can arrive earlier than injected (a few ms of clock slack); on a shared 2-core machine
lateness is bounded generously, while means of gaps scheduled on absolute times stay tight."""
from __future__ import annotations

import pytest

TTFT_MS, ITL_MS, OUT = 200.0, 40.0, 6
EARLY_SLACK_MS = 5.0
LATE_MS = 150.0


@pytest.mark.parametrize("backend", ["completions", "chat", "generate"])
def test_ttft_itl_tpot_e2e_match_injected_delays(backend, fault_server, run_bench):
    srv = fault_server(ttft_ms=TTFT_MS, itl_ms=ITL_MS)
    res = run_bench(srv.url, "--backend", backend, "--num-prompts", "4", "--input-len", "12", "--output-len",
                    str(OUT), "--warmup-requests", "0", "--request-rate", "inf")
    ph = res["phases"][0]
    assert ph["completed"] == 4 and ph["failed"] == 0 and ph["errors"] == {}
    reqs = ph["requests"]
    for r in reqs:
        assert r["ok"]
        assert TTFT_MS - EARLY_SLACK_MS <= r["ttft_s"] * 1000 <= TTFT_MS + LATE_MS
        assert len(r["itl_s"]) == OUT - 1  # one gap per later token: the chat role chunk is not a token
        assert min(r["itl_s"]) * 1000 >= 0
        assert sum(r["itl_s"]) / len(r["itl_s"]) * 1000 == pytest.approx(ITL_MS, abs=15)
        assert r["tpot_s"] * 1000 == pytest.approx(ITL_MS, abs=15)
        expect_e2e = TTFT_MS + (OUT - 1) * ITL_MS
        assert expect_e2e - EARLY_SLACK_MS <= r["e2e_s"] * 1000 <= expect_e2e + LATE_MS
        assert r["output_tokens"] == OUT and r["prompt_tokens"] == 12  # the server counts words
    assert ph["ttft_ms"]["count"] == 4 and ph["itl_ms"]["count"] == 4 * (OUT - 1)
    assert ph["itl_coverage"] == 1.0  # one chunk per token here, so ITL is per token
    assert TTFT_MS - EARLY_SLACK_MS <= ph["ttft_ms"]["p50"] <= TTFT_MS + LATE_MS
    assert ph["itl_ms"]["mean"] == pytest.approx(ITL_MS, abs=15)
    assert ph["tokens_source"] == (["meta_info"] if backend == "generate" else ["usage"])


def test_goodput_follows_the_slo_against_injected_ttft(fault_server, run_bench):
    srv = fault_server(ttft_ms=TTFT_MS, itl_ms=10)
    args = ("--num-prompts", "3", "--input-len", "4", "--output-len", "3", "--warmup-requests", "0")
    missed = run_bench(srv.url, *args, "--slo-ttft-ms", str(TTFT_MS / 2))["phases"][0]
    assert missed["completed"] == 3
    assert missed["goodput"]["requests"] == 0 and missed["goodput"]["fraction"] == 0.0
    met = run_bench(srv.url, *args, "--slo-ttft-ms", "5000", "--slo-tpot-ms", "5000")["phases"][0]
    assert met["goodput"]["requests"] == 3 and met["goodput"]["fraction"] == 1.0
    assert met["goodput"]["request_rate"] == pytest.approx(met["request_throughput"])
    tight_tpot = run_bench(srv.url, *args, "--slo-tpot-ms", "1")["phases"][0]
    assert tight_tpot["goodput"]["requests"] == 0  # 10 ms per token cannot meet 1 ms
