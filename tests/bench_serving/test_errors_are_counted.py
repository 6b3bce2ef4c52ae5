"""Failed requests are counted by kind, keep their messages, and lower goodput; none is dropped or hidden."""
from __future__ import annotations

import json

import httpx

from tests.helpers import free_port

ARGS = ("--input-len", "4", "--output-len", "3", "--warmup-requests", "0", "--slo-ttft-ms", "10000")


def _check_totals(ph: dict, planned: int) -> None:
    assert ph["requests_planned"] == planned
    assert ph["completed"] + ph["failed"] + ph["not_sent"] == planned
    assert sum(ph["errors"].values()) == ph["failed"]
    assert ph["goodput"]["requests"] == ph["completed"]  # errors never count as good
    assert ph["goodput"]["fraction"] == ph["completed"] / ph["requests_sent"]
    assert sum(1 for r in ph["requests"] if not r["ok"]) == ph["failed"] + ph["not_sent"]


def test_http_errors_are_counted_by_status(fault_server, run_bench):
    srv = fault_server(fail_every=3, fail_status=503)
    ph = run_bench(srv.url, "--num-prompts", "9", "--max-concurrency", "1", *ARGS)["phases"][0]
    assert ph["errors"] == {"http_503": 3}
    assert ph["completed"] == 6
    assert any("injected failure" in m for m in ph["error_samples"]["http_503"])
    assert sorted(r["status"] for r in ph["requests"] if not r["ok"]) == [503, 503, 503]
    assert ph["ttft_ms"]["count"] == 6  # latency statistics cover the successes only
    _check_totals(ph, 9)


def test_error_events_inside_a_stream_are_counted(fault_server, run_bench):
    srv = fault_server(stream_error_every=2)
    ph = run_bench(srv.url, "--backend", "chat", "--num-prompts", "6", "--max-concurrency", "1", *ARGS)["phases"][0]
    assert ph["errors"] == {"stream_error:injected": 3}
    assert ph["completed"] == 3
    assert any("injected stream error" in m for m in ph["error_samples"]["stream_error:injected"])
    assert ph["total_output_tokens"] == 3 * 3  # tokens of failed requests are not counted as served
    _check_totals(ph, 6)


def test_dropped_connections_are_counted(fault_server, run_bench):
    srv = fault_server(drop_every=2)
    ph = run_bench(srv.url, "--backend", "generate", "--num-prompts", "4", "--max-concurrency", "1",
                   *ARGS)["phases"][0]
    assert ph["failed"] == 2 and ph["completed"] == 2
    assert set(ph["errors"]) <= {"connection_lost", "incomplete_stream"}
    _check_totals(ph, 4)


def test_a_target_that_is_not_there_is_all_errors(run_bench):
    url = f"http://127.0.0.1:{free_port()}"
    ph = run_bench(url, "--num-prompts", "3", *ARGS)["phases"][0]
    assert ph["errors"] == {"connection_error": 3}
    assert ph["completed"] == 0 and ph["request_throughput"] == 0
    assert ph["ttft_ms"]["p50"] is None
    assert ph["server_metrics"]["scrape_errors"]  # the failed scrape is reported, not fatal
    _check_totals(ph, 3)


def test_multi_turn_conversation_stops_at_a_failed_turn(fault_server, run_bench):
    srv = fault_server(fail_every=2)
    ph = run_bench(srv.url, "--workload", "multi-turn", "--num-turns", "3", "--num-prompts", "1",
                   *ARGS)["phases"][0]
    # turn 1 succeeds, turn 2 fails (arrival 2), turn 3 cannot be sent without turn 2's answer
    assert [r["ok"] for r in ph["requests"]] == [True, False, False]
    assert ph["completed"] == 1 and ph["failed"] == 1 and ph["not_sent"] == 1
    assert httpx.get(srv.url + "/stats").json()["arrivals"] == 2
    _check_totals(ph, 3)


def test_api_key_is_sent_but_never_recorded(fault_server, run_bench):
    srv = fault_server(require_key="s3cret")
    ok = run_bench(srv.url, "--num-prompts", "2", *ARGS, "--api-key", "s3cret")
    assert ok["phases"][0]["completed"] == 2
    assert "s3cret" not in json.dumps(ok)
    assert ok["config"]["target"]["api_key"] == "<redacted>"
    refused = run_bench(srv.url, "--num-prompts", "2", *ARGS, "--api-key=wrong")["phases"][0]
    assert refused["errors"] == {"http_401": 2}


def test_a_failed_warmup_is_recorded_and_reported(fault_server, run_bench, caplog):
    srv = fault_server(fail_every=1, fail_status=502)
    res = run_bench(srv.url, "--num-prompts", "1", *ARGS[:4], "--warmup-requests", "1")
    assert res["target"]["warmup"] == [{"ok": False, "error": "http_502",
                                        "error_message": "injected failure of request 1"}]
    assert "a warmup request failed (http_502" in caplog.text
    assert res["phases"][0]["errors"] == {"http_502": 1}
