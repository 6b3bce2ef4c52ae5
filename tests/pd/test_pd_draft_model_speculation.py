"""A decode worker that speculates with a draft model (the tiny model drafting for itself) gives, through the
router, the colocated server's exact output, greedy and seeded, on short prompts and on prompts longer than a
prefill chunk. The draft model's KV for the prompt is computed on the decode worker (the prefill worker knows
nothing of the draft), drafts are verified there, and both of the decode worker's pools return to idle."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pd.conftest import Cluster, metric_sum, run_cluster, wait_pool_idle
from tests.pd.test_pd_matches_colocated import PROMPTS, SAMPLING, fresh, generate


@pytest.fixture(scope="module")
def spec_cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    yield from run_cluster(tiny_model_dir, "--speculative-algorithm", "draft_model",
                           "--speculative-draft-model-path", str(tiny_model_dir),
                           "--speculative-policy", "acceptance")  # a self-draft never pays: draft regardless


@pytest.mark.parametrize("mode", list(SAMPLING))
def test_a_drafting_decode_worker_gives_the_colocated_output(spec_cluster: Cluster, mode: str) -> None:
    for text in PROMPTS:
        fresh(spec_cluster)
        assert generate(spec_cluster.router.url, text, SAMPLING[mode]) == generate(
            spec_cluster.colocated.url, text, SAMPLING[mode]), text[:40]
    assert metric_sum(spec_cluster.decode.url, "splitserve_spec_draft_tokens_total") > 0
    for srv in (spec_cluster.prefill, spec_cluster.decode, spec_cluster.colocated):
        wait_pool_idle(srv)
