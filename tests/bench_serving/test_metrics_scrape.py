"""/metrics is scraped before and after each phase: counters become deltas, gauges values, and KV transfer
totals are reported when the target has them (a PD worker does; the fault server imitates one)."""
from __future__ import annotations

from benchmarks.serving.scrape import parse_prometheus, summarize

TEXT = """# HELP splitserve_prompt_tokens_total Prompt tokens
# TYPE splitserve_prompt_tokens counter
splitserve_prompt_tokens_total{role="prefill"} 30.0
splitserve_prompt_tokens_total{role="decode"} 10.0
# TYPE splitserve_kv_pages_total gauge
splitserve_kv_pages_total{role="prefill"} 4096.0
# TYPE splitserve_time_to_first_token_seconds histogram
splitserve_time_to_first_token_seconds_bucket{le="0.1"} 3.0
splitserve_time_to_first_token_seconds_sum 0.25
splitserve_time_to_first_token_seconds_count 3.0
splitserve_untyped_total 7
other_metric_total 1
"""


def test_prometheus_text_is_parsed_by_type():
    series, counters = parse_prometheus(TEXT, "splitserve_")
    assert series['splitserve_prompt_tokens_total{role="prefill"}'] == 30.0
    assert not any("_bucket" in k or k.startswith("other") for k in series)
    assert counters == {"splitserve_prompt_tokens_total", "splitserve_time_to_first_token_seconds_sum",
                        "splitserve_time_to_first_token_seconds_count", "splitserve_untyped_total"}


def test_counters_are_summed_over_labels_and_urls_and_differenced():
    def snap(scale: float) -> dict:
        series, counters = parse_prometheus(TEXT.replace("30.0", str(30.0 * scale)), "splitserve_")
        return {"http://a/metrics": {"ok": True, "error": None, "series": series, "counters": sorted(counters)},
                "http://b/metrics": {"ok": False, "error": "URLError: refused", "series": {}, "counters": []}}
    s = summarize(snap(1), snap(2), "splitserve_")
    assert s["counter_deltas"]["splitserve_prompt_tokens_total"] == 30.0  # (60 + 10) - (30 + 10)
    assert s["prompt_tokens"] == 30.0
    assert s["gauges_after"]["splitserve_kv_pages_total"] == 4096.0
    assert s["scrape_errors"] == {"http://b/metrics": "URLError: refused"}
    assert s["prefix_cache_hit_rate"] is None and s["kv_transfer_bytes"] is None


def test_kv_transfer_bytes_are_reported_when_the_target_has_them(fault_server, run_bench):
    srv = fault_server(kv_bytes_per_token=1000)
    ph = run_bench(srv.url, "--num-prompts", "4", "--input-len", "10", "--output-len", "2",
                   "--warmup-requests", "1")["phases"][0]
    sm = ph["server_metrics"]
    assert sm["prompt_tokens"] == ph["total_input_tokens"] == 40  # the warmup happened before the first scrape
    assert sm["kv_transfer_bytes"] == 40 * 1000
    assert sm["kv_transfer"] == {"splitserve_kv_transfer_bytes_total": 40_000}
    assert sm["generation_tokens"] == 8
    assert sm["prefix_cache_hit_rate"] == 0.0
    assert "other_metric_total" not in sm["counter_deltas"]  # only the --metrics-prefix family is kept


def test_several_metrics_urls_are_summed(fault_server, run_bench):
    a, b = fault_server(kv_bytes_per_token=1), fault_server(kv_bytes_per_token=1)
    ph = run_bench(a.url, "--num-prompts", "2", "--input-len", "5", "--output-len", "2", "--warmup-requests", "0",
                   "--metrics-url", a.url + "/metrics", b.url + "/metrics")["phases"][0]
    sm = ph["server_metrics"]
    assert sm["urls"] == sorted([a.url + "/metrics", b.url + "/metrics"])
    assert sm["kv_transfer_bytes"] == 10  # all of it on a; b saw no traffic
    by_url = sm["counter_deltas_by_url"]
    assert by_url[a.url + "/metrics"]["splitserve_generation_tokens_total"] == 4
    assert by_url[b.url + "/metrics"]["splitserve_generation_tokens_total"] == 0
    assert sm["gauges_after"]["splitserve_num_running_reqs"] == 0


def test_scraping_can_be_turned_off(fault_server, run_bench):
    srv = fault_server()
    ph = run_bench(srv.url, "--num-prompts", "1", "--output-len", "2", "--no-scrape-metrics")["phases"][0]
    assert ph["server_metrics"] is None and ph["completed"] == 1


def test_proxy_settings_do_not_redirect_any_traffic(fault_server, run_bench, monkeypatch):
    srv = fault_server()
    dead = "http://127.0.0.1:9"  # nothing listens there: anything sent through it would fail
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, dead)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    ph = run_bench(srv.url, "--num-prompts", "2", "--output-len", "2", "--warmup-requests", "0")["phases"][0]
    assert ph["completed"] == 2
    assert ph["server_metrics"]["scrape_errors"] == {} and ph["server_metrics"]["generation_tokens"] == 4
