"""Prefill and decode workers forced onto Mooncake (TCP on loopback) instead of shared memory: the engine's
scattered KV pages cross through the decode worker's staging slots, and the output through the router is
token-identical to the colocated server's. Both pools go back to idle afterwards."""
from __future__ import annotations

from pathlib import Path

import httpx

from tests.pd.conftest import metric_sum, start_colocated, start_decode, start_prefill, start_router, wait_pool_idle
from tests.pd.test_pd_matches_colocated import LONG, SHORT, generate

MOONCAKE = ["--transfer-backend", "mooncake", "--transfer-hostname", "127.0.0.1"]


def test_pd_over_mooncake_is_token_identical_and_stages_pages(tiny_model_dir: Path) -> None:
    prefill, bport = start_prefill(tiny_model_dir, *MOONCAKE)
    decode = start_decode(tiny_model_dir, *MOONCAKE)
    colocated = start_colocated(tiny_model_dir)
    router = None
    try:
        for srv in (prefill, decode, colocated):
            srv.wait_ready()
        router = start_router(prefill, bport, decode).wait_ready(path="/readiness")
        for text in (SHORT, LONG):
            for url in (router.url, colocated.url):
                assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
            params = {"temperature": 0.0}
            assert generate(router.url, text, params) == generate(colocated.url, text, params)
        staged = metric_sum(prefill.url, "splitserve_kv_transfer_staged_bytes_total")
        sent = metric_sum(prefill.url, "splitserve_kv_transfer_bytes_total")
        assert staged > 0 and staged <= sent  # the pages went through the staging slots
        assert metric_sum(decode.url, "splitserve_kv_transfer_failures_total") == 0
        wait_pool_idle(prefill)
        wait_pool_idle(decode)
    finally:
        if router is not None:
            router.stop()
        for srv in (prefill, decode, colocated):
            srv.stop()
