"""A float32 model with `--kv-cache-dtype bfloat16` on both workers: the prefill worker pushes bfloat16 pages,
and the output through the router is token-identical to a colocated server with the same flag. Both pools go
back to idle afterwards. (A pair whose cache dtypes differ is refused: test_layout_mismatch_is_refused.py.)"""
from __future__ import annotations

from pathlib import Path

import httpx

from tests.pd.conftest import metric_sum, start_colocated, start_decode, start_prefill, start_router, wait_pool_idle
from tests.pd.test_pd_matches_colocated import LONG, SHORT, generate

BF16_KV = ("--kv-cache-dtype", "bfloat16")


def test_pd_with_bfloat16_kv_is_token_identical(tiny_model_dir: Path) -> None:
    prefill, bport = start_prefill(tiny_model_dir, *BF16_KV)
    decode = start_decode(tiny_model_dir, *BF16_KV)
    colocated = start_colocated(tiny_model_dir, *BF16_KV)
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
        assert metric_sum(prefill.url, "splitserve_kv_transfer_bytes_total") > 0
        assert metric_sum(decode.url, "splitserve_kv_transfer_failures_total") == 0
        wait_pool_idle(prefill)
        wait_pool_idle(decode)
    finally:
        if router is not None:
            router.stop()
        for srv in (prefill, decode, colocated):
            srv.stop()
