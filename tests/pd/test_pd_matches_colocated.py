"""Through the router, prefill + decode give the colocated server's exact output: short prompts, prompts long
enough for several prefill chunks, prompts sharing prefixes, and multi-turn chats; greedy and seeded sampling,
streamed and not. Later chat turns reuse the decode worker's cache, so fewer KV bytes cross the wire.

Bitwise-equal logits need the same computation on both sides, so single requests are compared from empty
caches (the same prefill chunks, then the same decode steps). A multi-turn chat is compared with the
colocated server keeping its cache across turns, the closest path to the decode worker's reuse."""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.pd.conftest import Cluster

SHORT = "Hello there"
LONG = " ".join(f"item{i} costs {i * 7 % 13} coins;" for i in range(60))  # ~400 tokens: 13 chunks of 32
SHARED = "You are a careful assistant who answers in lists. " * 4
PROMPTS = [SHORT, LONG, SHARED + "First question?", SHARED + "Second, different question?"]
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "top_p": 0.9, "sampling_seed": 7}}


def fresh(cluster: Cluster) -> None:
    """Empty every prefix cache (the router fans /flush_cache out to the prefill and decode workers)."""
    for url in (cluster.router.url, cluster.colocated.url):
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200


def generate(url: str, text: str, params: dict) -> list[int]:
    r = httpx.post(url + "/generate", timeout=120, json={
        "text": text, "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, **params}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


@pytest.mark.parametrize("mode", list(SAMPLING))
def test_generate_is_token_identical(cluster: Cluster, mode: str) -> None:
    for text in PROMPTS:
        fresh(cluster)
        assert generate(cluster.router.url, text, SAMPLING[mode]) == generate(cluster.colocated.url, text,
                                                                              SAMPLING[mode]), text[:40]
    # prompts sharing a prefix: the second one's prefix comes from each side's cache, the same way
    fresh(cluster)
    ours = [generate(cluster.router.url, t, SAMPLING[mode]) for t in PROMPTS[2:]]
    assert ours == [generate(cluster.colocated.url, t, SAMPLING[mode]) for t in PROMPTS[2:]]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat_text(url: str, messages: list[dict], stream: bool, max_tokens: int = 20, **kw: object) -> str:
    c = client(url)
    if not stream:
        return c.chat.completions.create(model="tiny-model-v1", messages=messages, max_tokens=max_tokens,
                                         **kw).choices[0].message.content
    return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny-model-v1", messages=messages, max_tokens=max_tokens, stream=True, **kw) if ch.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_and_chat_are_identical_streamed_or_not(cluster: Cluster, stream: bool) -> None:
    msgs = [{"role": "user", "content": LONG[:300]}]
    for kw in ({"temperature": 0.0}, {"temperature": 0.7, "seed": 11}):
        fresh(cluster)
        assert chat_text(cluster.router.url, msgs, stream, **kw) == chat_text(cluster.colocated.url, msgs, False,
                                                                              **kw)
    fresh(cluster)
    pd = client(cluster.router.url).completions.create(model="tiny-model-v1", prompt=SHORT, max_tokens=12,
                                                         temperature=0, stream=stream)
    text = "".join(c.choices[0].text for c in pd) if stream else pd.choices[0].text
    ref = client(cluster.colocated.url).completions.create(model="tiny-model-v1", prompt=SHORT, max_tokens=12,
                                                           temperature=0)
    assert text == ref.choices[0].text


def transfer_bytes(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r'^splitserve_kv_transfer_bytes_total\{role="decode"\} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_multi_turn_chat_is_identical_and_reuses_the_decode_cache(cluster: Cluster) -> None:
    bytes_per_token = 2 * 4 * 4 * 32 * 4  # K and V x layers x KV heads x head dim x float32 (tiny model)
    history: list[dict] = [{"role": "system", "content": SHARED}]
    sent, prompt_tokens = [], []
    fresh(cluster)
    for turn in range(4):
        history.append({"role": "user", "content": f"Turn {turn}: tell me more about item {turn}."})
        before = transfer_bytes(cluster.decode.url)
        resp = client(cluster.router.url).chat.completions.create(model="tiny-model-v1", messages=history,
                                                                  max_tokens=16, temperature=0)
        sent.append(transfer_bytes(cluster.decode.url) - before)
        prompt_tokens.append(resp.usage.prompt_tokens)
        answer = resp.choices[0].message.content
        assert answer == chat_text(cluster.colocated.url, history, False, max_tokens=16, temperature=0)
        history.append({"role": "assistant", "content": answer})
    full = [t * bytes_per_token for t in prompt_tokens]
    assert sent[0] >= full[0]  # the first turn ships the whole prompt (rounded up to pages)
    for turn in range(1, 4):  # later turns ship only what the decode worker's cache lacks
        assert sent[turn] < 0.6 * full[turn], (turn, sent, full)
    print(f"4-turn chat: {sum(sent):.0f} bytes sent of {sum(full):.0f} ({1 - sum(sent) / sum(full):.0%} saved)")


def test_logprobs_match_including_the_first_token(cluster: Cluster) -> None:
    msgs = [{"role": "user", "content": "Give me numbers"}]
    results = []
    for url in (cluster.router.url, cluster.colocated.url):
        fresh(cluster)
        out = client(url).chat.completions.create(model="tiny-model-v1", messages=msgs, max_tokens=6,
                                                  temperature=0, logprobs=True, top_logprobs=3)
        results.append([(c.token, round(c.logprob, 4), [(t.token, round(t.logprob, 4)) for t in c.top_logprobs])
                        for c in out.choices[0].logprobs.content])
    assert len(results[0]) == 6 and results[0] == results[1]


def completion_texts(url: str, body: dict) -> dict[int, str]:
    """Each choice's text by index, from a streamed or plain /v1/completions answer."""
    import json
    if not body.get("stream"):
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return {c["index"]: c["text"] for c in r.json()["choices"]}
    texts: dict[int, str] = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_batch_prompts_get_a_room_each(cluster: Cluster, stream: bool) -> None:
    """A batch of prompts (text or token ids, with n > 1) through the router: each (prompt, choice) gets its own
    room on both workers, and every choice equals the colocated server's answer for its prompt."""
    for prompt in (["Hello there", "A second, longer prompt about pages"], [[5, 6, 7], [8, 9, 10, 11, 12]]):
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "n": 2, "ignore_eos": True}
        fresh(cluster)
        pd = completion_texts(cluster.router.url, {**body, "stream": stream})
        ref: dict[int, str] = {}
        for i, one in enumerate(prompt):
            fresh(cluster)
            texts = completion_texts(cluster.colocated.url, {**body, "prompt": one})
            ref |= {2 * i + k: v for k, v in texts.items()}
        assert pd == ref


def test_logit_bias_and_penalties_are_honoured_on_both_workers(cluster: Cluster) -> None:
    for params in ({"logit_bias": {"300": 100}}, {"presence_penalty": 1.5, "repetition_penalty": 1.2},
                   {"frequency_penalty": 1.0, "temperature": 0.8, "sampling_seed": 3}):
        fresh(cluster)
        params = {"temperature": 0.0, **params}
        ours = generate(cluster.router.url, SHORT, params)
        assert ours == generate(cluster.colocated.url, SHORT, params)
        if "logit_bias" in params:
            assert ours == [300] * 24  # the first token too: the prefill worker sampled it under the bias
