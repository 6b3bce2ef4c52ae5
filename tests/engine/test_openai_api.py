"""The colocated server's API through the real ``openai`` client and raw HTTP: chat and completions, streamed
and not, usage with cached tokens, n > 1 with seeds, stop strings, logprobs, /generate, info endpoints."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import ServerProcess


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def test_chat_completion_and_its_stream_agree(client: openai.OpenAI, model: str) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about radix trees."}]
    full = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    assert full.usage.completion_tokens == 24 and full.usage.prompt_tokens > 10
    stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, reasons, usage = "", [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert text == choice.message.content
    assert reasons[-1] == "length" and usage is not None and usage.completion_tokens == 24


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI, model: str) -> None:
    prompt = "A shared system prompt that is long enough to fill several pages of the KV cache. " * 3
    first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=model, prompt=prompt + "more", max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0 or first.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= 40


def test_streamed_completion_ends_with_done(server: ServerProcess, model: str) -> None:
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": model, "prompt": "Hello", "max_tokens": 6, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_n_choices_with_a_seed_are_reproducible_and_distinct(client: openai.OpenAI, model: str) -> None:
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, n=3, temperature=1.0, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    assert a.usage.completion_tokens == 36


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, model: str) -> None:
    base = client.completions.create(model=model, prompt="The list:", max_tokens=20, temperature=0).choices[0].text
    stop = base[5:9]
    assert stop.strip(), base
    out = client.completions.create(model=model, prompt="The list:", max_tokens=20, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == base[: base.index(stop)]


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-5  # greedy picks the top token


def test_generate_with_token_ids_and_batches(server: ServerProcess) -> None:
    one = httpx.post(server.url + "/generate", timeout=60, json={
        "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()
    assert len(one["output_ids"]) == 5 and one["meta_info"]["prompt_tokens"] == 4
    assert one["meta_info"]["finish_reason"] == {"type": "length"}
    batch = httpx.post(server.url + "/generate", timeout=60, json={
        "text": ["first prompt", "second prompt"], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    assert isinstance(batch, list) and len(batch) == 2 and all(len(b["output_ids"]) == 3 for b in batch)
    again = httpx.post(server.url + "/generate", timeout=60, json={
        "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 5, "temperature": 0}}).json()
    assert again["output_ids"] == one["output_ids"]


def test_info_and_load_endpoints(server: ServerProcess, model: str) -> None:
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["served_model_name"] == model and info["architecture"] == "LlamaForCausalLM"
    assert httpx.get(server.url + "/get_server_info").json()["role"] == "colocated"
    load = httpx.get(server.url + "/get_load").json()
    assert set(load) == {"running", "queued", "kv_pages_used", "kv_pages_total"} and load["kv_pages_total"] > 0
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
