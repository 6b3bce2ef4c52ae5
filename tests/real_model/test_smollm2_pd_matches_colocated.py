"""On the real model, a prefill worker and a decode worker behind the router give the colocated server's exact
greedy output, with KV pages over shared memory and over Mooncake (TCP on loopback): single prompts (one chunk
and several) and a 3-turn chat through the real ``openai`` client, where later turns reuse cached prefixes.
Both pools go back to idle afterwards."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pd.conftest import Cluster, metric_sum, run_cluster, wait_pool_idle
from tests.pd.test_pd_matches_colocated import client, fresh, generate
from tests.real_model.conftest import SERVED_NAME

PROMPTS = ["The capital of France is",
           "Write a short story about a robot who learns to paint. " * 6]  # ~80 tokens: three 32-token chunks
TURNS = ["Hi! Can you suggest a name for a cat?", "Why that one?", "Give me two more names."]
TRANSPORTS = {"shm": ("--transfer-backend", "shm"),
              "mooncake": ("--transfer-backend", "mooncake", "--transfer-hostname", "127.0.0.1")}


@pytest.fixture(scope="module", params=list(TRANSPORTS))
def real_cluster(request: pytest.FixtureRequest, smollm2_gguf: Path) -> Iterator[Cluster]:
    yield from run_cluster(smollm2_gguf, worker_flags=TRANSPORTS[request.param])


def test_prompts_and_a_three_turn_chat_are_token_identical(real_cluster: Cluster) -> None:
    for text in PROMPTS:
        fresh(real_cluster)
        params = {"temperature": 0.0}
        assert generate(real_cluster.router.url, text, params) == generate(real_cluster.colocated.url, text, params)

    fresh(real_cluster)
    history: list[dict] = []
    answers = []
    for turn in TURNS:
        history.append({"role": "user", "content": turn})
        pd, ref = (client(srv.url).chat.completions.create(model=SERVED_NAME, messages=history, max_tokens=32,
                                                           temperature=0)
                   for srv in (real_cluster.router, real_cluster.colocated))
        assert pd.choices[0].message.content == ref.choices[0].message.content, turn
        assert pd.choices[0].finish_reason == ref.choices[0].finish_reason
        answers.append(pd.choices[0].message.content)
        history.append({"role": "assistant", "content": answers[-1]})
    assert all(answers) and len(set(answers)) == 3, answers  # real, distinct answers
    assert metric_sum(real_cluster.decode.url, "splitserve_kv_transfer_failures_total") == 0
    wait_pool_idle(real_cluster.prefill)
    wait_pool_idle(real_cluster.decode)
