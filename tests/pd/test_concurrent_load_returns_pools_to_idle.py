"""Dozens of requests in flight through the router, more than the decode pool holds at once: admission
waits for pages (never over-commits), every output is the colocated server's, and afterwards both workers'
pools are back to their idle size.

Batches of different sizes round differently in the last bits, so a reference token is only required where
the reference itself had no near-tie (top-2 log-probability gap above 1e-4); after a tolerated near-tie the
two sequences may legitimately diverge and comparison stops there."""
from __future__ import annotations

import concurrent.futures
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.pd.conftest import Cluster, run_cluster, wait_pool_idle

N_REQUESTS = 40
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def small_cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    # a decode pool of 1024 tokens holds about 6 of these requests at once
    yield from run_cluster(tiny_model_dir, "--decode-reserve-tokens", "32", decode_tokens=1024)


def run(url: str, ids: list[int]) -> dict:
    r = httpx.post(url + "/generate", timeout=300, json={
        "input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def agrees(ours: list[int], ref: dict) -> bool:
    for i, (token, top) in enumerate(zip(ref["output_ids"], ref["meta_info"]["output_top_logprobs"])):
        if ours[i] != token:
            return len(top) == 2 and abs(top[0][0] - top[1][0]) < NEAR_TIE and ours[i] == top[1][1]
        if len(top) == 2 and abs(top[0][0] - top[1][0]) < NEAR_TIE:
            return True  # a near-tie the other side resolved the same way: later tokens may differ
    return len(ours) == len(ref["output_ids"])


def test_concurrent_requests_beyond_the_decode_pool_all_finish_correctly(small_cluster: Cluster) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 4000) for _ in range(rng.randrange(20, 120))] for _ in range(N_REQUESTS)]
    with concurrent.futures.ThreadPoolExecutor(N_REQUESTS) as pool:
        results = list(pool.map(lambda p: run(small_cluster.router.url, p), prompts))
    refs = [run(small_cluster.colocated.url, p) for p in prompts]
    for ours, ref in zip(results, refs):
        assert len(ours["output_ids"]) == 12
        assert agrees(ours["output_ids"], ref), (ours["output_ids"], ref["output_ids"])
    for srv in (small_cluster.prefill, small_cluster.decode):
        wait_pool_idle(srv)


def test_a_prompt_larger_than_the_decode_pool_is_refused(small_cluster: Cluster) -> None:
    r = httpx.post(small_cluster.router.url + "/generate", timeout=60,
                   json={"input_ids": list(range(10, 2010)), "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
    for srv in (small_cluster.prefill, small_cluster.decode):
        wait_pool_idle(srv, timeout=30)  # the prefill side's room ends at its bootstrap deadline at the latest
