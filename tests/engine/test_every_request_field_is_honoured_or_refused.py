"""Every request field is honoured, documented as harmless, or refused with a 400 that names it (docs/api.md):
unknown fields, output constraints the grammar could not enforce, malformed tools, OpenAI's bounds for temperature and stop,
best_of (honoured: the n best of best_of candidates by cumulative logprob), and logit_bias, which is honoured (+100 forces a token, -100 bans it)."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import ServerProcess

CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6, "temperature": 0}


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "min_tokens": 3}, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "regex": "a", "ebnf": "root ::= \"a\""}, "ebnf"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"not": {}}}}}}]}, "tools"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "tools": []}, "tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": 150}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "lora_name": "x"}, "lora_name"),
    ("/generate", {"text": "hi", "return_text_in_logprobs": True}, "return_text_in_logprobs"),
    ("/generate", {"text": "hi", "sampling_params": {"logit_bias": {"-3": 1}}}, "logit_bias"),
])
def test_unsupported_or_invalid_fields_are_refused_by_name(server: ServerProcess, path: str, body: dict,
                                                           param: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"], err


@pytest.mark.parametrize("extra", [
    {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
    {"response_format": {"type": "text"}, "tool_choice": "none"},
    {"temperature": 2.0, "stop": ["a", "b", "c", "d"]},
])
def test_harmless_and_default_valued_fields_are_accepted(server: ServerProcess, extra: dict) -> None:
    r = post(server, "/v1/chat/completions", {**CHAT, **extra})
    assert r.status_code == 200, r.text
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "best_of": 1})
    assert r.status_code == 200, r.text


def test_logit_bias_forces_and_bans_tokens(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = client.models.list().data[0].id

    def generate(n: int = 8, **kw: object) -> dict:
        r = httpx.post(server.url + "/generate", timeout=60, json={
            "text": "The sea is", "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True,
                                                      **kw}})
        assert r.status_code == 200, r.text
        return r.json()

    def tokens(**kw: object) -> list[int]:
        return generate(**kw)["output_ids"]

    plain = tokens()
    assert tokens(logit_bias={"300": 100}) == [300] * 8
    banned = tokens(logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0] and plain[0] not in banned
    # the OpenAI routes take the same field, with the SDK's own types
    forced = client.completions.create(model=model, prompt="The sea is", max_tokens=4, temperature=0.9,
                                       logit_bias={"300": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == generate(4, logit_bias={"300": 100})["text"]


def test_best_of_returns_the_most_likely_candidates(server: ServerProcess) -> None:
    base = {"prompt": "The sea is", "max_tokens": 6, "temperature": 1.0, "seed": 11}
    every = post(server, "/v1/completions", {**base, "n": 4, "logprobs": 0}).json()
    scores = sorted(((sum(c["logprobs"]["token_logprobs"]), c["text"]) for c in every["choices"]), reverse=True)
    best = post(server, "/v1/completions", {**base, "n": 2, "best_of": 4}).json()
    assert [c["text"] for c in best["choices"]] == [t for _, t in scores[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1] and best["choices"][0]["logprobs"] is None
    assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]  # all four were generated
