"""Each workload against a real colocated server on the tiny model: the run completes, its JSON has every
field, and its numbers agree with what the server itself reports (usage per request, /metrics counters)."""
from __future__ import annotations

import json

import pytest

TOP_LEVEL = {"schema", "label", "command", "config", "target", "workload", "versions", "machine", "started_at",
             "finished_at", "duration_s", "phases", "plots"}
PHASE = {"name", "request_rate", "max_concurrency", "arrival", "hit_max_duration", "cache_flush", "duration_s",
         "requests_planned", "requests_sent", "not_sent", "completed", "failed", "errors", "error_samples",
         "request_throughput", "input_token_throughput", "output_token_throughput", "total_token_throughput",
         "total_input_tokens", "total_output_tokens", "total_cached_tokens", "planned_output_tokens",
         "output_len_mismatches", "usage_cache_hit_rate", "tokens_source", "itl_coverage", "goodput", "ttft_ms",
         "itl_ms", "tpot_ms", "e2e_ms", "server_metrics", "requests"}
DIST = {"count", "mean", "min", "p50", "p90", "p99", "max"}
PAGE = 4  # the colocated fixture's page size: prefix matches are page-aligned
SMALL = ("--warmup-requests", "1", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000")


def check_consistent(res: dict, backend: str) -> None:
    assert set(res) == TOP_LEVEL
    assert res["config"]["target"]["backend"] == backend
    assert res["target"]["model"] == "tiny-model-v1" and res["target"]["server_info"]["role"] == "colocated"
    assert res["workload"]["tokenizer"]["length_unit"] == "tokens"  # found via the server's /get_model_info
    for key in ("python", "splitserve", "aiohttp", "git_commit"):
        assert key in res["versions"]
    assert res["machine"]["cpu_count"] >= 1
    for ph in res["phases"]:
        assert PHASE <= set(ph), PHASE - set(ph)
        assert ph["failed"] == 0 and ph["not_sent"] == 0 and ph["errors"] == {}
        assert ph["completed"] == ph["requests_planned"] == len(ph["requests"])
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            assert set(ph[key]) == DIST
            assert ph[key]["min"] <= ph[key]["p50"] <= ph[key]["p90"] <= ph[key]["p99"] <= ph[key]["max"]
        reqs = ph["requests"]
        # ignore_eos makes output lengths exact, as the server's usage confirms
        assert all(r["output_tokens"] == r["planned_output_tokens"] for r in reqs)
        assert ph["output_len_mismatches"] == 0
        assert ph["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)
        assert ph["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs)
        assert all(r["e2e_s"] >= r["ttft_s"] > 0 for r in reqs)
        assert all(len(r["itl_s"]) <= r["output_tokens"] - 1 for r in reqs)
        # the server's own counters over the phase agree with the per-request usage
        sm = ph["server_metrics"]
        assert sm["scrape_errors"] == {}
        assert sm["prompt_tokens"] == ph["total_input_tokens"]
        assert sm["generation_tokens"] == ph["total_output_tokens"]
        assert sm["cached_prompt_tokens"] == ph["total_cached_tokens"]
        assert sm["counter_deltas"]["splitserve_requests_total"] == ph["completed"]
        assert sm["prefix_cache_hit_rate"] == pytest.approx(ph["usage_cache_hit_rate"])
        assert "splitserve_kv_pages_total" in sm["gauges_after"]  # a gauge, though its name ends in _total
        assert sm["kv_transfer_bytes"] is None and sm["kv_transfer"] == {}  # colocated: no KV transfer
        assert ph["goodput"]["requests"] == ph["completed"]
    json.dumps(res, allow_nan=False)  # strict JSON


def test_random_lengths_over_completions_with_a_rate_sweep_and_plots(colocated, run_bench):
    res = run_bench(colocated.url, "--workload", "random", "--num-prompts", "4", "--input-len", "24",
                    "--output-len", "5", "--length-dist", "uniform", "--request-rate", "20", "inf", *SMALL,
                    plots=True)
    check_consistent(res, "completions")
    assert [p["name"] for p in res["phases"]] == ["rate=20", "rate=inf"]
    outs = [r["output_tokens"] for r in res["phases"][0]["requests"]]
    assert len(set(outs)) > 1  # uniform output lengths, each one honoured exactly
    assert all(p["cache_flush"] == "flushed" for p in res["phases"])
    assert res["phases"][1]["total_cached_tokens"] == 0  # the flush kept phase 2 from reusing phase 1
    assert len(res["plots"]) == 2
    for path in res["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        import matplotlib.image
        img = matplotlib.image.imread(path)
        assert img.shape[0] > 100 and img.shape[1] > 100


def test_shared_prefix_over_chat_hits_the_prefix_cache(colocated, run_bench):
    prefix = 64
    res = run_bench(colocated.url, "--workload", "shared-prefix", "--backend", "chat", "--num-prompts", "6",
                    "--num-groups", "2", "--prefix-len", str(prefix), "--suffix-len", "8", "--output-len", "3",
                    "--max-concurrency", "1", *SMALL)
    check_consistent(res, "chat")
    ph = res["phases"][0]
    groups = res["workload"]["item_groups"]
    seen: set[int] = set()
    for r in sorted(ph["requests"], key=lambda r: r["start_s"]):
        g = groups[r["item"]]
        if g in seen:  # a later request of the same tenant reuses at least the system prompt
            assert r["cached_tokens"] >= prefix - PAGE
        seen.add(g)
    assert ph["server_metrics"]["prefix_cache_hit_rate"] > 0.3


def test_multi_turn_over_chat_resends_history_and_reuses_it(colocated, run_bench):
    res = run_bench(colocated.url, "--workload", "multi-turn", "--backend", "chat", "--num-prompts", "2",
                    "--num-turns", "2", "--input-len", "12", "--output-len", "4", *SMALL)
    check_consistent(res, "chat")
    ph = res["phases"][0]
    assert set(ph["by_tag"]) == {"turn1", "turn2"}
    by_item: dict[int, dict[int, dict]] = {}
    for r in ph["requests"]:
        by_item.setdefault(r["item"], {})[r["turn"]] = r
    for turns in by_item.values():
        first, second = turns[0], turns[1]
        assert second["start_s"] >= first["start_s"] + first["e2e_s"]  # a turn waits for the previous answer
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["output_tokens"]
        assert second["cached_tokens"] >= first["prompt_tokens"] - PAGE  # the history is reused


def test_interference_over_generate_reports_short_and_long_separately(colocated, run_bench):
    res = run_bench(colocated.url, "--workload", "interference", "--backend", "generate", "--num-prompts", "6",
                    "--input-len", "16", "--output-len", "4", "--long-prompt-len", "512", "--long-output-len",
                    "2", "--long-every", "3", "--request-rate", "50", "--arrival", "constant", *SMALL)
    check_consistent(res, "generate")
    ph = res["phases"][0]
    assert ph["tokens_source"] == ["meta_info"]
    assert ph["by_tag"]["long"]["completed"] == 2 and ph["by_tag"]["short"]["completed"] == 4
    longs = [r for r in ph["requests"] if r["tag"] == "long"]
    assert all(abs(r["prompt_tokens"] - 512) <= 3 for r in longs)


def test_jsonl_file_over_completions(colocated, run_bench, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"question number {i}: what is {i} plus {i}?",
                                          "output_len": 2 + i}) for i in range(3)) + "\n")
    res = run_bench(colocated.url, "--workload", "jsonl", "--dataset-path", str(path), *SMALL)
    check_consistent(res, "completions")
    assert sorted(r["output_tokens"] for r in res["phases"][0]["requests"]) == [2, 3, 4]
