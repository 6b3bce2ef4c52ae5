"""Two prefill workers with one Mooncake Store (a real ``mooncake_master``; each worker gives it memory): prompts
first served through the first prefill worker are served through the second with their system prompts read
from the store (cached tokens reported by the response and counted by the second worker's store metrics),
token-identical to a colocated server without HiCache; every pool is idle afterwards."""
from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from tests.helpers import MooncakeMaster, wait_until
from tests.pd.conftest import metric_sum, start_colocated, start_decode, start_prefill, start_router, wait_pool_idle
from tests.pd.test_pd_with_hicache_matches_colocated import generate

pytest.importorskip("mooncake.store")
TENANTS, SYSTEM = 4, 64


def test_the_second_prefill_worker_reads_the_first_ones_prefixes_from_the_store(tiny_model_dir: Path) -> None:
    rng = random.Random(11)
    prompts = [[rng.randrange(10, 4000) for _ in range(SYSTEM + 5)] for _ in range(TENANTS)]
    master = MooncakeMaster().start()
    hicache = ("--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake",
               "--hicache-storage-backend-extra-config", master.extra_config())
    first, first_port = start_prefill(tiny_model_dir, *hicache)
    second, second_port = start_prefill(tiny_model_dir, *hicache)
    decode, colocated = start_decode(tiny_model_dir), start_colocated(tiny_model_dir)
    servers, routers = [first, second, decode, colocated], []
    try:
        for srv in servers:
            srv.wait_ready()
        for prefill, port in ((first, first_port), (second, second_port)):  # one router per prefill worker
            routers.append(start_router(prefill, port, decode).wait_ready(path="/readiness"))
        cold = [generate(colocated.url, ids)["output_ids"] for ids in prompts]
        for ids, want in zip(prompts, cold):
            out = generate(routers[0].url, ids)
            assert out["output_ids"] == want and out["meta_info"]["cached_tokens"] == 0
        wait_until(lambda: metric_sum(first.url, "splitserve_hicache_stored_tokens_total") >= TENANTS * SYSTEM,
                   10, 0.05, "the first worker's store writes (they run behind its engine)")
        assert httpx.post(decode.url + "/flush_cache", timeout=30).status_code == 200  # no reuse on decode
        for ids, want in zip(prompts, cold):
            out = generate(routers[1].url, ids)
            assert out["output_ids"] == want
            assert out["meta_info"]["cached_tokens"] >= SYSTEM, out["meta_info"]
        assert metric_sum(second.url, "splitserve_hicache_store_loaded_tokens_total") >= TENANTS * SYSTEM
        assert metric_sum(second.url, "splitserve_hicache_store_failures_total") == 0
        info = httpx.get(second.url + "/get_server_info", timeout=10).json()["hicache"]
        assert info["storage_backend"] == "mooncake" and info["store_state"] == "up"
        for srv in (first, second, decode):
            wait_pool_idle(srv)
    finally:
        for srv in routers + servers:
            srv.stop()
        master.kill()
