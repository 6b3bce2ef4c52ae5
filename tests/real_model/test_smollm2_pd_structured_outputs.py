"""Structured output through a prefill/decode pair and the router, on the real model: the prefill worker samples
the first token under the grammar, the decode worker rebuilds the matcher from the grammar and that token and
goes on (jump-forward included), so the 20 seeded schemas give the colocated server's exact greedy answers, and
sampled ones sent together all validate; a regex through /generate matches; a bad grammar is refused by the router's workers
with the same 400; forced tool calls and a frontend program equal the colocated ones; both pools end idle."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.pd.conftest import Cluster, metric_sum, run_cluster, wait_pool_idle
from tests.real_model.conftest import SERVED_NAME
from tests.real_model.structured import SCHEMA_SEEDS, ask_all, assert_valid, client, schema_request
from tests.schemas import random_schema


@pytest.fixture(scope="module")
def real_cluster(smollm2_gguf: Path) -> Iterator[Cluster]:
    yield from run_cluster(smollm2_gguf, worker_flags=("--transfer-backend", "shm"))


def test_seeded_schemas_through_pd_equal_colocated_and_validate(real_cluster: Cluster) -> None:
    """One request at a time: a different batch mix changes float rounding, and greedy ties with it."""
    bodies = [schema_request(s, sampled=False) for s in SCHEMA_SEEDS]
    pd = ask_all(real_cluster.router.url, bodies, threads=1)
    ref = ask_all(real_cluster.colocated.url, bodies, threads=1)
    for seed, a, b in zip(SCHEMA_SEEDS, pd, ref):
        assert_valid(a, random_schema(seed))
        assert a.choices[0].message.content == b.choices[0].message.content, seed
        assert a.usage.completion_tokens == b.usage.completion_tokens
    assert metric_sum(real_cluster.decode.url, "splitserve_grammar_jump_forward_tokens_total") > 0
    wait_pool_idle(real_cluster.prefill)
    wait_pool_idle(real_cluster.decode)


def test_sampled_schemas_through_pd_validate_under_load(real_cluster: Cluster) -> None:
    answers = ask_all(real_cluster.router.url, [schema_request(s, sampled=True) for s in SCHEMA_SEEDS])
    for seed, a in zip(SCHEMA_SEEDS, answers):
        assert_valid(a, random_schema(seed))
    wait_pool_idle(real_cluster.prefill)
    wait_pool_idle(real_cluster.decode)


def test_regex_through_generate_and_a_bad_grammar_through_the_router(real_cluster: Cluster) -> None:
    pattern = r" (red|green|blue|yellow)\."
    r = httpx.post(real_cluster.router.url + "/generate", timeout=120, json={
        "text": "My favourite colour is", "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                              "regex": pattern}})
    assert r.status_code == 200 and re.fullmatch(pattern, r.json()["text"]), r.text
    with pytest.raises(openai.BadRequestError) as e:
        client(real_cluster.router.url).chat.completions.create(
            model=SERVED_NAME, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
            extra_body={"regex": "(unclosed"})
    assert e.value.body["param"] == "regex", e.value.body
    wait_pool_idle(real_cluster.prefill)
    wait_pool_idle(real_cluster.decode)


def test_tool_calls_through_pd_equal_colocated(real_cluster: Cluster) -> None:
    from tests.real_model.test_smollm2_tool_calls import ASK, TOOLS, valid_calls
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        answers = [client(url).chat.completions.create(model=SERVED_NAME, messages=ASK, tools=TOOLS, max_tokens=100,
                                                       tool_choice=choice, temperature=0)
                   for url in (real_cluster.router.url, real_cluster.colocated.url)]
        pd, ref = (valid_calls(a.choices[0].message) for a in answers)
        assert pd == ref and pd and answers[0].choices[0].finish_reason == "tool_calls"
    wait_pool_idle(real_cluster.prefill)
    wait_pool_idle(real_cluster.decode)


def test_a_frontend_program_through_pd_equals_colocated(real_cluster: Cluster) -> None:
    from frontend import Endpoint
    from tests.real_model.test_frontend_programs import multi_turn_question
    args = {"question_1": "What is the capital of Italy?", "question_2": "Name one dish from there."}
    pd, ref = (multi_turn_question.run(backend=Endpoint(url), **args)
               for url in (real_cluster.router.url, real_cluster.colocated.url))
    assert pd.token_ids() == ref.token_ids() and pd["answer_2"]
    assert pd.meta("answer_2")["cached_tokens"] > 0  # the decode worker's cache held the first turn
    wait_pool_idle(real_cluster.prefill)
    wait_pool_idle(real_cluster.decode)
