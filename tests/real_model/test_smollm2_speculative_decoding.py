"""On the real model, speculative decoding (n-gram on a colocated server; a draft model, SmolLM2 itself in bfloat16
under the float32 target, on a decode worker behind the PD router) gives exactly the output of a server without it,
through the real ``openai`` client: greedy chat on copy-heavy and ordinary prompts (with a stop string that falls
inside accepted drafts), streamed and not, and seeded sampling with n = 2 and logprobs. The copy task really
speculates (accepted drafts counted on both speculating servers) and every pool returns to idle. In process,
bfloat16 with the n-gram tree gives plain decoding's tokens where every layer's decode rows go through the
batch-invariant kernels."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import SpeculativeConfig
from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core
from tests.pd.conftest import Cluster, metric_sum, run_cluster, start_colocated, wait_pool_idle
from tests.pd.test_pd_matches_colocated import client
from tests.real_model.conftest import SERVED_NAME

SPEC = ("--speculative-algorithm", "ngram")
DOC = ("The Mooncake Transfer Engine moves data between the memory of different machines. It supports TCP, RDMA "
       "and NVLink, and it registers memory regions once so that later transfers need no copies. A prefill worker "
       "writes the KV cache of a prompt into pages that a decode worker reserved before the prompt was computed.")
TASKS = [f"Repeat the following text exactly, word for word:\n\n{DOC}",
         "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\nRewrite these with type hints.",
         "Name three colours of the rainbow."]
NAME = "--served-model-name"


@pytest.fixture(scope="module")
def servers(smollm2_gguf: Path) -> Iterator[tuple[Cluster, object]]:
    spec_colocated = start_colocated(smollm2_gguf, NAME, SERVED_NAME, *SPEC)
    try:
        draft = ("--speculative-algorithm", "draft_model", "--speculative-draft-model-path", str(smollm2_gguf),
                 "--speculative-draft-dtype", "bfloat16", "--speculative-policy", "acceptance")
        for cluster in run_cluster(smollm2_gguf, *draft, flags=(NAME, SERVED_NAME)):
            spec_colocated.wait_ready()
            yield cluster, spec_colocated
    finally:
        spec_colocated.stop()


def chat(url: str, task: str, stream: bool = False, **kw: object) -> tuple[str, str, int | None]:
    c = client(url)
    messages = [{"role": "user", "content": task}]
    if stream:
        chunks = list(c.chat.completions.create(model=SERVED_NAME, messages=messages, stream=True, **kw))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        reason = next(ch.choices[0].finish_reason for ch in reversed(chunks) if ch.choices)
        return text, reason, None
    r = c.chat.completions.create(model=SERVED_NAME, messages=messages, **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens


def test_greedy_chat_is_identical_with_speculation(servers: tuple[Cluster, object]) -> None:
    cluster, spec = servers
    urls = [cluster.colocated.url, spec.url, cluster.router.url]  # reference first
    for task in TASKS:
        for kw in ({}, {"stream": True}):
            outs = [chat(u, task, max_tokens=80, temperature=0, **kw) for u in urls]
            assert outs[1] == outs[0] and outs[2] == outs[0], task
    stopped = [chat(u, TASKS[0], max_tokens=80, temperature=0, stop=["NVLink"]) for u in urls]
    assert stopped[0][1] == "stop" and "NVLink" not in stopped[0][0] and stopped[1:] == [stopped[0]] * 2
    accepted = metric_sum(spec.url, "splitserve_spec_accepted_tokens_total")
    assert accepted > 20, f"the n-gram server accepted {accepted} draft tokens on the copy task"
    # the draft model drafts wherever acceptance allows (--speculative-policy acceptance: its costs barely pay here)
    assert metric_sum(cluster.decode.url, "splitserve_spec_accepted_tokens_total") > 0
    assert metric_sum(cluster.colocated.url, "splitserve_spec_draft_tokens_total") == 0


def test_seeded_sampling_with_n_and_logprobs_is_identical(servers: tuple[Cluster, object]) -> None:
    cluster, spec = servers
    outs = []
    for url in (cluster.colocated.url, spec.url, cluster.router.url):
        r = client(url).completions.create(model=SERVED_NAME, prompt=TASKS[0], max_tokens=48, temperature=0.7,
                                           seed=7, n=2, logprobs=2)
        outs.append([(c.text, c.logprobs.tokens, c.logprobs.token_logprobs)
                     for c in sorted(r.choices, key=lambda c: c.index)])
    for other in outs[1:]:  # the same tokens; logprobs equal up to summation order (a verification computes
        for (text, tokens, lps), (want_text, want_tokens, want_lps) in zip(other, outs[0]):  # several rows at once)
            assert (text, tokens) == (want_text, want_tokens) and len(lps) == len(want_lps)
            assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4
    assert outs[0][0][0] != outs[0][1][0], "two different samples"
    for srv in (cluster.colocated, spec, cluster.prefill, cluster.decode):
        wait_pool_idle(srv)


def test_bfloat16_tree_speculation_gives_plain_decodings_tokens(smollm2_gguf: Path) -> None:
    """In bfloat16 a token tree's nodes off the chain attend over their path's slots; the kernel sums those keys as
    it sums keys in pages, so the output is plain decoding's token for token. benchmarks/bench_spec.py's copy task
    1 (rewrite a function) parted at token 124 on a Zen 4 host when the path's keys came after the pages."""
    tasks = json.loads((Path(__file__).parents[2] / "benchmarks/data/spec_copy_tasks.json").read_text())["tasks"]
    ngram = SpeculativeConfig(speculative_algorithm="ngram", speculative_policy="acceptance")
    cores = [make_core(smollm2_gguf, page_size=16, dtype="bfloat16", speculative=spec)
             for spec in (SpeculativeConfig(), ngram)]
    model = cores[1].runner.model
    routes = [m.few_rows_operands() for m in model.modules() if hasattr(m, "few_rows_operands")]
    if any(isinstance(m, torch.nn.Linear) for m in model.modules()) or not routes or any(
            r is None or not set(range(1, 17)) <= set(r.rows) for r in routes):
        pytest.skip("some bfloat16 layer takes 1-16 rows through oneDNN or MKL on this host (no AVX-512 BF16, or "
                    "its calibration): their sums depend on the row count, so near-ties may flip")
    prompts = [cores[0].tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in tasks[:2]]
    outs = []
    for core in cores:
        reqs = [core.make_request(p, SamplingParams(max_new_tokens=128, temperature=0.0), detokenize=False)
                for p in prompts]
        for r in reqs:  # one at a time: batch 1, where the tree verifies most nodes
            core.run_to_completion([r])
        outs.append([r.output_ids for r in reqs])
        core.check_integrity()
    assert outs[1] == outs[0]
    assert cores[1].spec.accepted > 100, cores[1].spec.accepted
