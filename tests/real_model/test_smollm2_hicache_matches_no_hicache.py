"""On the real model, HiCache changes where a prefix's KV comes from, never what is generated: three tenants
with long system prompts ask twice, round-robin, through the ``openai`` client. A server whose pool holds about
two tenants (so every second-round prompt was evicted to the host tier, and stored in a file store) answers with
exactly the text and logprobs of a server whose pool keeps every prompt, both reporting the system prompt as
cached; then a fresh server on the same store directory, its own tiers empty, gets the prefixes from the store
and answers the same again."""
from __future__ import annotations

from pathlib import Path

from tests.pd.conftest import metric_sum, start_colocated, wait_pool_idle
from tests.pd.test_pd_matches_colocated import client
from tests.real_model.conftest import SERVED_NAME

TOPICS = ["a lighthouse keeper", "a bakery in Lyon", "the history of the bicycle"]
QUESTIONS = ["What should I know first?", "Give me one surprising fact."]


def system(topic: str) -> str:
    return (f"You are an assistant who only talks about {topic}. " + "Answer in two short sentences, plainly, "
            "without lists, without greetings, and without repeating the question. " * 12)


def ask(url: str, topic: str, question: str) -> tuple[str, list[float], int]:
    r = client(url).chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "system", "content": system(topic)},
                                     {"role": "user", "content": question}],
        max_tokens=16, temperature=0, logprobs=True)
    lps = [t.logprob for t in r.choices[0].logprobs.content]
    return r.choices[0].message.content, lps, r.usage.prompt_tokens_details.cached_tokens


def test_smollm2_with_hicache_answers_like_a_pool_that_keeps_everything(smollm2_gguf: Path,
                                                                         tmp_path: Path) -> None:
    hicache = ("--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-storage-backend", "file",
               "--hicache-storage-dir", str(tmp_path / "store"))
    name = ("--served-model-name", SERVED_NAME)
    keeps_all = start_colocated(smollm2_gguf, *name, tokens=8192)
    small = start_colocated(smollm2_gguf, *name, *hicache, tokens=600)
    servers = [keeps_all, small]
    try:
        for srv in servers:
            srv.wait_ready()
        for rnd, question in enumerate(QUESTIONS):
            for topic in TOPICS:
                want, got = ask(keeps_all.url, topic, question), ask(small.url, topic, question)
                assert got[:2] == want[:2], (topic, question)
                if rnd:  # the system prompt (over 200 tokens) came from L1 on one and the host tier on the other
                    assert got[2] == want[2] > 200
        assert metric_sum(small.url, "splitserve_hicache_loaded_tokens_total") > 200 * len(TOPICS)
        fresh = start_colocated(smollm2_gguf, *name, *hicache, tokens=600)
        servers.append(fresh)
        fresh.wait_ready()
        for topic in TOPICS:
            want, got = ask(keeps_all.url, topic, QUESTIONS[1]), ask(fresh.url, topic, QUESTIONS[1])
            assert got[0] == want[0] and got[2] > 200, topic  # logprobs: the remainder may be chunked otherwise
            assert max(abs(a - b) for a, b in zip(got[1], want[1])) < 1e-4
        assert metric_sum(fresh.url, "splitserve_hicache_store_loaded_tokens_total") > 200 * len(TOPICS)
        for srv in servers:
            wait_pool_idle(srv)
    finally:
        for srv in servers:
            srv.stop()
