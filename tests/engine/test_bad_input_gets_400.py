"""Bad input gets an OpenAI-style JSON error with a 4xx status, and the server keeps serving."""
from __future__ import annotations

import httpx
import pytest

from tests.helpers import ServerProcess

LONG = "word " * 20000
CASES = [
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", {"prompt": 123}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens must be at least 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10_000_000}, "exceeds the context length"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 1}, "context length"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": [99999999]}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, "not served here"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -7}, "top_k"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"messages": []}, "messages: List should have at least 1 item"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokenz": 3}}, "max_new_tokenz"),
    ("/generate", {"sampling_params": {}}, "exactly one of text or input_ids"),
    ("/generate", [1, 2, 3], "invalid request"),
]


@pytest.mark.parametrize("path,body,needle", CASES, ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_bad_request_is_a_400_with_a_clear_message(server: ServerProcess, path: str, body: object,
                                                   needle: str) -> None:
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"], err


def test_unknown_path_is_a_json_404_and_server_stays_healthy(server: ServerProcess) -> None:
    r = httpx.get(server.url + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "still alive", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
