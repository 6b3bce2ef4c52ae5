"""/metrics exposes the names of ARCHITECTURE.md with values that follow the traffic."""
from __future__ import annotations

import re

import httpx

from tests.helpers import ServerProcess

NAMES = ["splitserve_num_running_reqs", "splitserve_num_queue_reqs", "splitserve_kv_pages_used",
         "splitserve_kv_pages_total", "splitserve_kv_pool_prefaulted_ratio", "splitserve_radix_cache_evictable_size",
         "splitserve_radix_cache_protected_size",
         "splitserve_prefix_cache_hit_rate", "splitserve_time_to_first_token_seconds_bucket",
         "splitserve_inter_token_latency_seconds_bucket", "splitserve_e2e_request_latency_seconds_bucket",
         "splitserve_prompt_tokens_total", "splitserve_generation_tokens_total"]


def value(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing"
    return float(m.group(1))


def test_metrics_follow_requests(server: ServerProcess) -> None:
    before = httpx.get(server.url + "/metrics").text
    prompt = "metrics prompt that repeats so the second request hits the prefix cache " * 2
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5  # a sampled EOS would stop it
    after = httpx.get(server.url + "/metrics").text
    for name in NAMES:
        value(after, name)
    assert value(after, "splitserve_generation_tokens_total") - value(before, "splitserve_generation_tokens_total") \
        == 10
    assert value(after, "splitserve_time_to_first_token_seconds_count") - \
        value(before, "splitserve_time_to_first_token_seconds_count") == 2
    assert value(after, "splitserve_prefix_cache_hit_rate") > 0
    assert value(after, "splitserve_radix_cache_evictable_size") > 0


def test_step_metrics_count_the_positions_each_step_computed(server: ServerProcess) -> None:
    def read() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics").text
        return {name: value(text, name) for name in (
            'splitserve_engine_step_tokens_total{kind="prefill",role="colocated"}',
            'splitserve_engine_step_tokens_total{kind="decode",role="colocated"}',
            'splitserve_engine_step_seconds_count{kind="decode",role="colocated"}',
            "splitserve_prompt_tokens_total", "splitserve_cached_prompt_tokens_total")}

    httpx.post(server.url + "/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=30)
    before = read()
    for prompt in ("step metrics: a prompt of its own", "step metrics: a prompt of its own, longer"):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    delta = {k: v - before[k] for k, v in read().items()}
    computed = delta["splitserve_prompt_tokens_total"] - delta["splitserve_cached_prompt_tokens_total"]
    assert delta['splitserve_engine_step_tokens_total{kind="prefill",role="colocated"}'] == computed > 0
    # the first token of each comes from its prompt's step; the other four from one decode step each
    assert delta['splitserve_engine_step_tokens_total{kind="decode",role="colocated"}'] == 8
    assert delta['splitserve_engine_step_seconds_count{kind="decode",role="colocated"}'] == 8
