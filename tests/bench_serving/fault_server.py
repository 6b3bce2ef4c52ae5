"""A small streaming server with known timings and injected faults, run as a real process on 127.0.0.1, so the
load tool's measurements can be checked against ground truth.

Every request streams ``max_tokens`` one-word tokens: the first ``--ttft-ms`` after the request arrived, each
later one ``--itl-ms`` after the previous (scheduled on absolute times, so the gaps do not drift). Faults by
the request's arrival number n (1-based): n % --fail-every == 0 gets an HTTP --fail-status error;
n % --stream-error-every == 0 streams one token then an error event; n % --drop-every == 0 streams one token
then drops the connection. --require-key KEY answers 401 without that key. Prompt tokens are the prompt's
words; /metrics counts them (and --kv-bytes-per-token bytes of fake KV transfer per prompt token, the way a
PD worker would report them). GET /stats tells the most requests ever in flight at once.

    python -m tests.bench_serving.fault_server --port 31000 --ttft-ms 200 --itl-ms 40 --fail-every 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web


@dataclass
class State:
    args: argparse.Namespace
    arrivals: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    flushes: int = 0


def _prompt_words(body: dict[str, Any], path: str) -> int:
    if path == "/v1/chat/completions":
        return sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
    return len(str(body.get("text" if path == "/generate" else "prompt", "")).split())


def _max_tokens(body: dict[str, Any], path: str) -> int:
    if path == "/generate":
        return int(body.get("sampling_params", {}).get("max_new_tokens", 16))
    return int(body.get("max_tokens") or 16)


def _chunk(path: str, i: int, ids: list[int], text: str, prompt: int) -> dict[str, Any]:
    if path == "/generate":
        return {"text": text, "output_ids": ids, "meta_info": {
            "prompt_tokens": prompt, "completion_tokens": len(ids), "cached_tokens": 0, "finish_reason": None}}
    if path == "/v1/chat/completions":
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}
    return {"object": "text_completion", "choices": [{"index": 0, "text": f" w{i}"}]}


async def _sse(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(f"data: {json.dumps(obj)}\n\n".encode())


async def generate(request: web.Request) -> web.StreamResponse:
    st: State = request.app["state"]
    arrived = time.perf_counter()
    st.arrivals += 1
    n = st.arrivals
    a = st.args
    body = await request.json()
    path = request.path
    if a.require_key and request.headers.get("Authorization") != f"Bearer {a.require_key}":
        return web.json_response({"error": {"message": "missing or wrong API key", "type": "authentication_error",
                                            "code": "invalid_api_key"}}, status=401)
    if a.fail_every and n % a.fail_every == 0:
        return web.json_response({"error": {"message": f"injected failure of request {n}", "type": "server_error",
                                            "code": str(a.fail_status)}}, status=a.fail_status)
    st.in_flight += 1
    st.max_in_flight = max(st.max_in_flight, st.in_flight)
    try:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if path == "/v1/chat/completions":  # a role-only first chunk, as OpenAI servers send
            await _sse(resp, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        prompt, out = _prompt_words(body, path), _max_tokens(body, path)
        ids: list[int] = []
        for i in range(out):
            due = arrived + (a.ttft_ms + i * a.itl_ms) / 1000
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            ids.append(100 + i)
            st.generation_tokens += 1
            await _sse(resp, _chunk(path, i, list(ids), " ".join(f"w{j}" for j in range(len(ids))), prompt))
            if a.stream_error_every and n % a.stream_error_every == 0:
                await _sse(resp, {"error": {"message": f"injected stream error of request {n}",
                                            "type": "server_error", "code": "injected"}})
                return resp
            if a.drop_every and n % a.drop_every == 0:
                assert request.transport is not None
                request.transport.abort()
                return resp
        st.prompt_tokens += prompt
        if path != "/generate" and (body.get("stream_options") or {}).get("include_usage"):
            await _sse(resp, {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": out,
                                                       "total_tokens": prompt + out,
                                                       "prompt_tokens_details": {"cached_tokens": 0}}})
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        st.in_flight -= 1


async def metrics(request: web.Request) -> web.Response:
    st: State = request.app["state"]
    kv = st.prompt_tokens * st.args.kv_bytes_per_token
    lines = ["# TYPE splitserve_prompt_tokens counter", f"splitserve_prompt_tokens_total {st.prompt_tokens}",
             "# TYPE splitserve_cached_prompt_tokens counter", "splitserve_cached_prompt_tokens_total 0",
             "# TYPE splitserve_generation_tokens counter",
             f"splitserve_generation_tokens_total {st.generation_tokens}",
             "# TYPE splitserve_num_running_reqs gauge", f"splitserve_num_running_reqs {st.in_flight}",
             "# TYPE other_metric counter", "other_metric_total 5"]
    if st.args.kv_bytes_per_token:
        lines += ["# TYPE splitserve_kv_transfer_bytes counter",
                  f'splitserve_kv_transfer_bytes_total{{backend="fake"}} {kv}']
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


async def stats(request: web.Request) -> web.Response:
    st: State = request.app["state"]
    return web.json_response({"arrivals": st.arrivals, "in_flight": st.in_flight,
                              "max_in_flight": st.max_in_flight, "flushes": st.flushes})


async def flush(request: web.Request) -> web.Response:
    request.app["state"].flushes += 1
    return web.json_response({"flushed_tokens": 0})


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fault-model", "object": "model"}]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def build_app(args: argparse.Namespace) -> web.Application:
    app = web.Application()
    app["state"] = State(args)
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        app.router.add_post(path, generate)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_post("/flush_cache", flush)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--fail-status", type=int, default=500)
    p.add_argument("--stream-error-every", type=int, default=0)
    p.add_argument("--drop-every", type=int, default=0)
    p.add_argument("--kv-bytes-per-token", type=int, default=0)
    p.add_argument("--require-key", default="")
    args = p.parse_args()
    web.run_app(build_app(args), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
