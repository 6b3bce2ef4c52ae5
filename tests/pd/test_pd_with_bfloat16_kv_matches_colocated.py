"""A float32 model with `--kv-cache-dtype bfloat16` on both workers: the prefill worker pushes bfloat16 pages,
and the output through the router is token-identical to a colocated server with the same flag. Both pools go
back to idle afterwards. (A pair whose cache dtypes differ is refused: test_layout_mismatch_is_refused.py.)"""
from __future__ import annotations

from pathlib import Path

from tests.pd.conftest import metric_sum, pd_cluster, wait_pool_idle
from tests.pd.test_pd_matches_colocated import LONG, SHORT, fresh, generate


def test_pd_with_bfloat16_kv_is_token_identical(tiny_model_dir: Path) -> None:
    with pd_cluster(tiny_model_dir, flags=("--kv-cache-dtype", "bfloat16")) as cluster:
        for text in (SHORT, LONG):
            fresh(cluster)
            params = {"temperature": 0.0}
            assert generate(cluster.router.url, text, params) == generate(cluster.colocated.url, text, params)
        assert metric_sum(cluster.prefill.url, "splitserve_kv_transfer_bytes_total") > 0
        assert metric_sum(cluster.decode.url, "splitserve_kv_transfer_failures_total") == 0
        wait_pool_idle(cluster.prefill)
        wait_pool_idle(cluster.decode)
