"""Through the router in PD mode, a worker's error reaches the client unchanged (status, type, param, code; no
internal address), invalid requests are neither retried nor counted against a worker's circuit breaker, and 200
mixed requests at concurrency 16 (penalties, logit_bias, batch prompts, invalid bodies interleaved) end with no
5xx: every valid one succeeds and every invalid one gets its 400."""
from __future__ import annotations

import asyncio
import json
import random

import httpx

from tests.pd.conftest import Cluster, wait_pool_idle

INVALID = [
    ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 4, "lora_name": "x"}, "lora_name"),
    ({"prompt": "hi", "max_tokens": 4, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"prompt": "hi", "max_tokens": 4, "temperature": 3}, "temperature"),
    ({"prompt": "hi", "max_tokens": 4, "regex": "a(b"}, "regex"),
    ({"prompt": "hi", "max_tokens": 4, "json_schema": {"type": "string", "format": "phone"}}, "json_schema"),
]
VALID = [
    {"prompt": "Once upon a time", "max_tokens": 6},
    {"prompt": "Once upon a time", "max_tokens": 6, "presence_penalty": 1.0, "frequency_penalty": 0.5},
    {"prompt": "Once upon a time", "max_tokens": 6, "repetition_penalty": 1.3, "temperature": 0.7, "seed": 1},
    {"prompt": "Once upon a time", "max_tokens": 6, "logit_bias": {"300": 50}},
    {"prompt": "Once upon a time", "max_tokens": 6, "regex": "[a-z ]+"},
    {"prompt": ["first of a batch", "second of a batch"], "max_tokens": 6},
    {"prompt": [[5, 6, 7], [8, 9, 10]], "max_tokens": 6, "n": 2, "stream": True},
]


def answered(text: str) -> bool:
    """A whole answer: choices in a JSON body, or a stream of chunks with choices ending in [DONE]."""
    if not text.startswith("data: "):
        return bool(json.loads(text).get("choices"))
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return events[-1] == "[DONE]" and all("choices" in json.loads(e) for e in events[:-1])


def test_worker_errors_pass_through_unchanged(cluster: Cluster) -> None:
    for body, param in INVALID:
        via_router = httpx.post(cluster.router.url + "/v1/completions", json=body, timeout=60)
        direct = httpx.post(cluster.colocated.url + "/v1/completions", json=body, timeout=60)
        assert via_router.status_code == direct.status_code == 400, via_router.text
        assert via_router.json() == direct.json(), (via_router.json(), direct.json())
        assert via_router.json()["error"]["param"] == param
        assert "127.0.0.1" not in via_router.text


def test_invalid_requests_do_not_trip_the_breaker(cluster: Cluster) -> None:
    for i in range(20):
        body, _ = INVALID[i % len(INVALID)]
        assert httpx.post(cluster.router.url + "/v1/completions", json=body, timeout=60).status_code == 400
    for body in VALID:
        r = httpx.post(cluster.router.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    workers = httpx.get(cluster.router.url + "/workers", timeout=10).json()["workers"]
    assert all(w["circuit"] == "closed" and w["healthy"] for w in workers), workers
    metrics = httpx.get(cluster.router.url + "/metrics", timeout=10).text
    assert 'retries_total{route="/v1/completions"}' not in metrics, "an invalid request was retried"


def test_two_hundred_mixed_requests_at_concurrency_16(cluster: Cluster) -> None:
    rng = random.Random(5)
    jobs = [(b, None) for b in VALID] * 24 + INVALID * 11  # 144 valid, 55 invalid, shuffled below
    jobs = (jobs + [(VALID[0], None)])[:200]
    rng.shuffle(jobs)
    results: list[tuple[int, bool]] = []
    failures: list[tuple[dict, int, str]] = []

    async def run() -> None:
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=cluster.router.url, timeout=120) as client:
            async def one(body: dict, param: str | None) -> None:
                async with sem:
                    r = await client.post("/v1/completions", json=body)
                    ok = (r.status_code == 200 and answered(r.text)) if param is None else (
                        r.status_code == 400 and r.json()["error"]["param"] == param)
                    results.append((r.status_code, ok))
                    if not ok:
                        failures.append((body, r.status_code, r.text[:300]))
            await asyncio.wait_for(asyncio.gather(*(one(b, p) for b, p in jobs)), 300)
    asyncio.run(run())
    statuses = sorted({s for s, _ in results})
    assert len(results) == 200 and not failures, (statuses, failures[:3])
    assert all(s < 500 for s, _ in results)
    wait_pool_idle(cluster.prefill)
    wait_pool_idle(cluster.decode)
