"""The router serves the workers' public API beside inference: /v1/models/{id} (the openai SDK's
``models.retrieve``), /tokenize and /detokenize in vLLM's shapes with the workers' answers; a wrong method on a
known path is a 405 with ``Allow`` (router and workers), and a worker's /abort_request with no body is a 400."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.pd.conftest import Cluster


def test_models_retrieve_through_the_router(cluster: Cluster) -> None:
    c = openai.OpenAI(base_url=cluster.router.url + "/v1", api_key="none", max_retries=0, timeout=30)
    model = c.models.list().data[0].id
    assert c.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")


@pytest.mark.parametrize("body", [
    {"prompt": "Hello there, pages!"},
    {"prompt": "Hello", "add_special_tokens": False, "return_token_strs": True},
    {"messages": [{"role": "user", "content": "Hi"}]},
])
def test_tokenize_and_detokenize_through_the_router(cluster: Cluster, body: dict) -> None:
    ours = httpx.post(cluster.router.url + "/tokenize", json=body, timeout=30)
    ref = httpx.post(cluster.colocated.url + "/tokenize", json=body, timeout=30)
    assert ours.status_code == 200 and ours.json() == ref.json()
    out = ours.json()
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0
    back = httpx.post(cluster.router.url + "/detokenize", json={"tokens": out["tokens"]}, timeout=30)
    assert back.status_code == 200
    if "prompt" in body:
        assert back.json()["prompt"].endswith(body["prompt"])
    bad = httpx.post(cluster.router.url + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("method, path, allow", [
    ("GET", "/v1/chat/completions", "POST"), ("PUT", "/generate", "POST"), ("POST", "/v1/models", "GET"),
    ("DELETE", "/tokenize", "POST"),
])
def test_wrong_method_is_a_405_naming_the_allowed_ones(cluster: Cluster, method: str, path: str, allow: str) -> None:
    for url in (cluster.router.url, cluster.decode.url, cluster.colocated.url):
        r = httpx.request(method, url + path, timeout=30)
        assert r.status_code == 405, (url, r.status_code, r.text)
        assert allow in r.headers["allow"] and r.json()["error"]["type"] == "invalid_request_error"


def test_abort_request_without_a_body_is_a_400(cluster: Cluster) -> None:
    for body in (None, b"", b"[1]", b"{}"):
        r = httpx.post(cluster.decode.url + "/abort_request", content=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
