"""Text that cannot be encoded (a lone UTF-16 surrogate like "\\ud800", which a JSON escape can carry, or bytes
that are not UTF-8) is refused with a 400 that says so and names the field, by the router and by every worker;
nothing reaches a tokenizer, and valid requests keep working."""
from __future__ import annotations

import pytest
import httpx

from tests.pd.conftest import Cluster, wait_pool_idle

LONE = b"a\\ud800b"  # as a JSON escape: the parsed string holds a lone surrogate
CASES = [
    ("/v1/completions", b'{"prompt": "' + LONE + b'", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "' + LONE + b'"], "max_tokens": 2}', "prompt.1"),
    ("/v1/completions", b'{"prompt": "ok", "stop": ["' + LONE + b'"], "max_tokens": 2}', "stop.0"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "' + LONE + b'"}], "max_tokens": 2}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "' + LONE
     + b'"}]}], "max_tokens": 2}', "messages.0.content.0.text"),
    ("/generate", b'{"text": "' + LONE + b'", "sampling_params": {"max_new_tokens": 2}}', "text"),
    ("/tokenize", b'{"prompt": "' + LONE + b'"}', "prompt"),
]


@pytest.mark.parametrize("path,body,param", CASES, ids=[c[2] for c in CASES])
def test_lone_surrogates_are_refused_by_name(cluster: Cluster, path: str, body: bytes, param: str) -> None:
    for srv in (cluster.router, cluster.prefill, cluster.decode, cluster.colocated):
        r = httpx.post(srv.url + path, content=body, timeout=30)
        assert r.status_code == 400, (srv.url, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "Unicode" in err["message"], (srv.url, err)
        if srv is not cluster.router or path == "/tokenize":  # the router refuses inference bodies itself
            assert err["param"] == param, (srv.url, err)


def test_bytes_that_are_not_utf8_are_refused(cluster: Cluster) -> None:
    body = b'{"prompt": "caf\xe9 \xed\xa0\x80", "max_tokens": 2}'  # Latin-1, and a surrogate encoded as UTF-8
    for srv in (cluster.router, cluster.prefill, cluster.decode, cluster.colocated):
        r = httpx.post(srv.url + "/v1/completions", content=body, timeout=30)
        assert r.status_code == 400, (srv.url, r.status_code, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
    ok = httpx.post(cluster.router.url + "/v1/completions", json={"prompt": "caf\u00e9 \U0001f600", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200, ok.text
    wait_pool_idle(cluster.prefill), wait_pool_idle(cluster.decode)
