"""HiCache on every server of a PD cluster whose pools hold about three tenants' prompts, with six tenants
asking twice: the second round's system prompts come back from the host tier on the prefill worker, on the
decode worker (whose cached prefix the prefill worker then need not send) and on the colocated reference,
outputs through the router equal the colocated server's token for token, /metrics and /get_server_info report
the host tier, and every pool (and host tier) is idle after a flush."""
from __future__ import annotations

import random
from pathlib import Path

import httpx

from tests.pd.conftest import metric_sum, pd_cluster, wait_pool_idle

TENANTS, SYSTEM = 6, 64
HICACHE = ("--enable-hierarchical-cache", "--hicache-write-policy", "write_back", "--max-total-tokens", "256")


def generate(url: str, ids: list[int]) -> dict:
    r = httpx.post(url + "/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    return r.json()


def test_pd_with_hicache_is_token_identical_and_loads_evicted_prefixes(tiny_model_dir: Path) -> None:
    rng = random.Random(5)
    systems = [[rng.randrange(10, 4000) for _ in range(SYSTEM)] for _ in range(TENANTS)]
    prompts = [s + [rng.randrange(10, 4000) for _ in range(6)] for _ in range(2) for s in systems]
    # the decode worker keeps 16 tokens of output headroom per request: its pool cycles like the others
    with pd_cluster(tiny_model_dir, "--max-total-tokens", "320", "--decode-reserve-tokens", "16",
                    flags=HICACHE) as cluster:
        for i, ids in enumerate(prompts):
            ours, ref = generate(cluster.router.url, ids), generate(cluster.colocated.url, ids)
            assert ours["output_ids"] == ref["output_ids"], i
            if i >= TENANTS:  # the pools cycled: without the host tier nothing of the prompt would be cached
                assert ref["meta_info"]["cached_tokens"] == SYSTEM
                assert ours["meta_info"]["cached_tokens"] == SYSTEM
        for srv in (cluster.prefill, cluster.decode, cluster.colocated):
            assert metric_sum(srv.url, "splitserve_hicache_loaded_tokens_total") >= TENANTS * SYSTEM // 2
            assert metric_sum(srv.url, "splitserve_hicache_load_seconds_count") > 0
            info = httpx.get(srv.url + "/get_server_info", timeout=10).json()
            assert info["hicache"]["write_policy"] == "write_back" and info["hicache"]["host_pages_used"] > 0
        for srv in (cluster.prefill, cluster.decode, cluster.colocated):
            wait_pool_idle(srv)
            assert httpx.get(srv.url + "/get_server_info", timeout=10).json()["hicache"]["host_pages_used"] == 0
