"""A decode worker dials only prefill bootstrap addresses it is allowed to (--prefill-allow; by default loopback
and private networks): a request naming any other address (a cloud metadata service, a public host, an unlisted
name) is refused with a 403 before anything is reserved or dialed, and nothing leaks. Allowed addresses work."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from decode_worker.allow import PrefillAllowList
from tests.pd.conftest import Cluster, bootstrap, start_decode, wait_pool_idle


def test_the_allow_list_matches_networks_addresses_names_and_ports() -> None:
    default = PrefillAllowList(("loopback", "private"))
    for host in ("127.0.0.1", "127.9.9.9", "::1", "localhost", "10.3.4.5", "172.20.0.1", "192.168.1.9", "fd00::7"):
        assert default.allows(host, 8998), host
    for host in ("169.254.169.254", "8.8.8.8", "172.32.0.1", "2001:db8::1", "example.com", "fe80::1"):
        assert not default.allows(host, 8998), host
    exact = PrefillAllowList(("10.1.2.3:8998", "prefill-0.svc", "[fd00::1]:9000", "192.168.7.0/24"))
    assert exact.allows("10.1.2.3", 8998) and not exact.allows("10.1.2.3", 8999)
    assert exact.allows("PREFILL-0.svc", 1) and exact.allows("fd00::1", 9000) and not exact.allows("fd00::1", 1)
    assert exact.allows("192.168.7.200", 5) and not exact.allows("127.0.0.1", 8998)
    assert PrefillAllowList(("*",)).allows("8.8.8.8", 1)
    with pytest.raises(ValueError, match="prefill-allow"):
        PrefillAllowList(("10.0.0.0/99",))


@pytest.mark.parametrize("host", ["169.254.169.254", "8.8.8.8", "example.com"])
def test_a_request_naming_another_address_is_refused(cluster: Cluster, host: str) -> None:
    body = {"prompt": "hello", "max_tokens": 2, **bootstrap(cluster.bport, 4242), "bootstrap_host": host}
    r = httpx.post(cluster.decode.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "prefill_not_allowed" and err["param"] == "bootstrap_host" and "--prefill-allow" in \
        err["message"], err
    assert httpx.post(cluster.router.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                      timeout=60).status_code == 200  # the router's loopback prefill is allowed
    wait_pool_idle(cluster.decode)


def test_a_narrow_allow_list_refuses_even_loopback(tiny_model_dir: Path) -> None:
    decode = start_decode(tiny_model_dir, "--prefill-allow", "10.1.2.3:8998")
    try:
        decode.wait_ready()
        body = {"prompt": "hello", "max_tokens": 2, **bootstrap(8998, 7)}
        r = httpx.post(decode.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 403 and "127.0.0.1:8998" in r.json()["error"]["message"], r.text
    finally:
        decode.stop()
