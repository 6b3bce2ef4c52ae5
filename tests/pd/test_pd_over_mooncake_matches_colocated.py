"""Prefill and decode workers forced onto Mooncake (TCP on loopback) instead of shared memory: the engine's
scattered KV pages cross through the decode worker's staging slots, and the output through the router is
token-identical to the colocated server's. Both pools go back to idle afterwards."""
from __future__ import annotations

from pathlib import Path

from tests.pd.conftest import metric_sum, pd_cluster, wait_pool_idle
from tests.pd.test_pd_matches_colocated import LONG, SHORT, fresh, generate

MOONCAKE = ("--transfer-backend", "mooncake", "--transfer-hostname", "127.0.0.1")


def test_pd_over_mooncake_is_token_identical_and_stages_pages(tiny_model_dir: Path) -> None:
    with pd_cluster(tiny_model_dir, worker_flags=MOONCAKE) as cluster:
        for text in (SHORT, LONG):
            fresh(cluster)
            params = {"temperature": 0.0}
            assert generate(cluster.router.url, text, params) == generate(cluster.colocated.url, text, params)
        staged = metric_sum(cluster.prefill.url, "splitserve_kv_transfer_staged_bytes_total")
        sent = metric_sum(cluster.prefill.url, "splitserve_kv_transfer_bytes_total")
        assert staged > 0 and staged <= sent  # the pages went through the staging slots
        assert metric_sum(cluster.decode.url, "splitserve_kv_transfer_failures_total") == 0
        wait_pool_idle(cluster.prefill)
        wait_pool_idle(cluster.decode)
