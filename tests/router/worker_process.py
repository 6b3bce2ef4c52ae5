"""A small stand-in worker process for the router's tests (no model): it serves the worker HTTP
contract of ARCHITECTURE.md on 127.0.0.1 with canned text, records what it receives, and can be
told to misbehave through `POST /_control`. In PD mode the prefill role runs a bootstrap server
on its bootstrap port that the decode role asks about each room, so a pair only succeeds when
the router sent both sides the same `bootstrap_room`, `bootstrap_host` and `bootstrap_port`.

Run: python tests/router/worker_process.py --port P --role regular|prefill|decode [--bootstrap-port B]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from aiohttp import web

DEFAULT_CONTROL: dict[str, Any] = {
    "fail_status": None,     # answer inference requests with this status ...
    "fail_count": -1,        # ... this many times (-1: always while fail_status is set)
    "delay_s": 0.0,          # before answering (prefill: before reporting the room done)
    "health": True,          # /health answers 503 when False
    "stream_chunks": 4,
    "chunk_delay_s": 0.0,
    "hold_after_first_chunk": False,  # stream: wait for POST /_release after the first chunk
    "die_mid_stream": False,  # stream: drop the connection after the first chunk
    "load": None,            # /get_load override {"running": n, "queued": m}
    "room_deadline_s": 3.0,  # decode: how long to wait for the prefill side of a room
    "silent_failure": False,
    "fail_after_room_s": None,  # prefill: report the room done, then answer 500 this much later  # prefill: fail without marking the room failed (a crashed peer)
}


class FakeWorker:
    def __init__(self, name: str, role: str, bootstrap_port: int | None, host: str = "127.0.0.1") -> None:
        self.name, self.role, self.bootstrap_port, self.host = name, role, bootstrap_port, host
        self.control: dict[str, Any] = dict(DEFAULT_CONTROL)
        self.requests: list[dict[str, Any]] = []
        self.rooms: dict[int, str] = {}
        self.flushes = 0
        self.running = 0
        self.release = asyncio.Event()
        self.cancelled: list[int] = []

    # ---- helpers -------------------------------------------------------------------------
    def error(self, status: int, message: str) -> web.Response:
        body = {"error": {"message": message, "type": "worker_error", "code": status}}
        return web.json_response(body, status=status)

    def should_fail(self) -> int | None:
        st, n = self.control["fail_status"], self.control["fail_count"]
        if st is None or n == 0:
            return None
        if n > 0:
            self.control["fail_count"] = n - 1
        return int(st)

    def answer(self, path: str, body: dict[str, Any], i: int) -> dict[str, Any]:
        text = f"{self.name}:{i}"
        if path == "/v1/chat/completions":
            return {"id": f"chat-{i}", "object": "chat.completion", "model": "fake-model", "worker": self.name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        if path == "/v1/completions":
            return {"id": f"cmpl-{i}", "object": "text_completion", "model": "fake-model", "worker": self.name,
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        return {"text": text, "worker": self.name, "meta_info": {"prompt_tokens": 3, "completion_tokens": 1}}

    def chunk(self, path: str, k: int) -> dict[str, Any]:
        piece = f"{self.name}#{k} "
        if path == "/v1/chat/completions":
            return {"object": "chat.completion.chunk", "model": "fake-model", "worker": self.name,
                    "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
        if path == "/v1/completions":
            return {"object": "text_completion", "model": "fake-model", "worker": self.name,
                    "choices": [{"index": 0, "text": piece, "finish_reason": None}]}
        return {"text": piece, "worker": self.name}

    # ---- PD --------------------------------------------------------------------------------
    async def prefill(self, body: dict[str, Any]) -> web.Response:
        rooms = body.get("bootstrap_room")
        rooms = rooms if isinstance(rooms, list) else [rooms]
        if any(not isinstance(r, int) for r in rooms):
            return self.error(400, "bootstrap_room missing")
        hosts = body.get("bootstrap_host")
        ports = body.get("bootstrap_port")
        hosts = hosts if isinstance(hosts, list) else [hosts]
        ports = ports if isinstance(ports, list) else [ports]
        if any(h != self.host for h in hosts) or any(p != self.bootstrap_port for p in ports):
            return self.error(400, f"bootstrap address {hosts}:{ports} is not this prefill worker")
        for r in rooms:
            self.rooms[r] = "transferring"
        if self.control["fail_after_room_s"] is not None:
            for r in rooms:
                self.rooms[r] = "success"
            await asyncio.sleep(float(self.control["fail_after_room_s"]))
            return self.error(500, f"prefill broke after room {rooms[0]} was transferred")
        try:
            await asyncio.sleep(self.control["delay_s"])
            status = self.should_fail()
        except asyncio.CancelledError:
            for r in rooms:
                self.rooms[r] = "failed"
            self.cancelled.extend(rooms)
            raise
        for r in rooms:
            if not (status and self.control["silent_failure"]):
                self.rooms[r] = "failed" if status else "success"
        if status:
            return self.error(status, f"prefill failed for room {rooms[0]}")
        return web.json_response({"prefill": "done", "rooms": rooms, "worker": self.name})

    async def wait_rooms(self, body: dict[str, Any]) -> str | None:
        """Decode side: None when every room's prefill succeeded, else the reason."""
        import aiohttp

        rooms = body.get("bootstrap_room")
        rooms = rooms if isinstance(rooms, list) else [rooms]
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        host = host[0] if isinstance(host, list) else host
        port = port[0] if isinstance(port, list) else port
        deadline = time.monotonic() + float(self.control["room_deadline_s"])
        async with aiohttp.ClientSession() as s:
            for room in rooms:
                while True:
                    try:
                        async with s.get(f"http://{host}:{port}/room/{room}") as r:
                            state = (await r.json())["state"]
                    except (aiohttp.ClientError, OSError) as e:
                        return f"bootstrap server {host}:{port} unreachable: {e}"
                    if state == "success":
                        break
                    if state == "failed":
                        return f"room {room} failed on the prefill side"
                    if time.monotonic() > deadline:
                        return f"room {room} timed out waiting for prefill"
                    await asyncio.sleep(0.01)
        return None

    # ---- handlers ----------------------------------------------------------------------------
    async def infer(self, req: web.Request) -> web.StreamResponse:
        try:
            body = await req.json()
        except json.JSONDecodeError as e:
            return self.error(400, f"bad json: {e}")
        i = len(self.requests)
        self.requests.append({"path": req.path, "headers": dict(req.headers), "body": body, "done": False})
        self.running += 1
        try:
            return await self._infer(req, body, i)
        except asyncio.CancelledError:
            self.requests[i]["cancelled"] = True
            raise
        finally:
            self.running -= 1

    async def _infer(self, req: web.Request, body: dict[str, Any], i: int) -> web.StreamResponse:
        if self.role == "prefill":
            return await self.prefill(body)
        if self.role == "regular":
            await asyncio.sleep(self.control["delay_s"])
            status = self.should_fail()
            if status:
                return self.error(status, f"{self.name} told to fail")
        stream = bool(body.get("stream"))
        if not stream:
            if self.role == "decode":
                reason = await self.wait_rooms(body)
                if reason:
                    return self.error(500, reason)
            self.requests[i]["done"] = True
            return web.json_response(self.answer(req.path, body, i))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        if self.role == "decode":
            reason = await self.wait_rooms(body)
            if reason:
                err = {"error": {"message": reason, "type": "worker_error", "code": 500}}
                await resp.write(f"data: {json.dumps(err)}\n\n".encode())
                return resp
        for k in range(int(self.control["stream_chunks"])):
            await resp.write(f"data: {json.dumps(self.chunk(req.path, k))}\n\n".encode())
            if k == 0 and self.control["die_mid_stream"]:
                assert req.transport is not None
                req.transport.abort()
                return resp
            if k == 0 and self.control["hold_after_first_chunk"]:
                await self.release.wait()
            await asyncio.sleep(self.control["chunk_delay_s"])
        await resp.write(b"data: [DONE]\n\n")
        self.requests[i]["done"] = True
        await resp.write_eof()
        return resp

    async def health(self, req: web.Request) -> web.Response:
        if not self.control["health"]:
            return self.error(503, "unhealthy (told so)")
        return web.json_response({"status": "ok"})

    async def get_load(self, req: web.Request) -> web.Response:
        load = self.control["load"] or {"running": self.running, "queued": 0}
        return web.json_response({"kv_pages_used": 0, "kv_pages_total": 100, **load})

    async def flush(self, req: web.Request) -> web.Response:
        self.flushes += 1
        return web.json_response({"flushed": True})

    async def control_h(self, req: web.Request) -> web.Response:
        self.control.update(await req.json())
        return web.json_response(self.control)

    async def release_h(self, req: web.Request) -> web.Response:
        self.release.set()
        return web.json_response({"released": True})

    async def state(self, req: web.Request) -> web.Response:
        return web.json_response({"requests": self.requests, "flushes": self.flushes,
                                  "rooms": {str(k): v for k, v in self.rooms.items()}, "cancelled": self.cancelled})

    async def room(self, req: web.Request) -> web.Response:
        return web.json_response({"state": self.rooms.get(int(req.match_info["room"]), "unknown")})

    def app(self) -> web.Application:
        a = web.Application()
        for p in ("/generate", "/v1/completions", "/v1/chat/completions"):
            a.router.add_post(p, self.infer)
        a.router.add_get("/health", self.health)
        a.router.add_get("/health_generate", self.health)
        a.router.add_get("/get_load", self.get_load)
        a.router.add_post("/flush_cache", self.flush)
        a.router.add_get("/v1/models", lambda r: web.json_response(
            {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": self.name}]}))
        a.router.add_get("/get_model_info", lambda r: web.json_response({"model_path": "fake-model", "worker": self.name}))
        a.router.add_get("/get_server_info", lambda r: web.json_response({"role": self.role, "worker": self.name}))
        a.router.add_get("/metrics", lambda r: web.Response(text="splitserve_fake 1\n"))
        a.router.add_post("/_control", self.control_h)
        a.router.add_post("/_release", self.release_h)
        a.router.add_get("/_state", self.state)
        return a


async def main(args: argparse.Namespace) -> None:
    w = FakeWorker(args.name or f"w{args.port}", args.role, args.bootstrap_port, args.host)
    runner = web.AppRunner(w.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    if args.role == "prefill" and args.bootstrap_port:
        boot = web.Application()
        boot.router.add_get("/room/{room}", w.room)
        brunner = web.AppRunner(boot, access_log=None)
        await brunner.setup()
        await web.TCPSite(brunner, args.host, args.bootstrap_port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--role", choices=("regular", "prefill", "decode"), default="regular")
    p.add_argument("--bootstrap-port", type=int, default=None)
    p.add_argument("--name", default=None)
    p.add_argument("--host", default="127.0.0.1", help="a loopback address (127.0.0.0/8)")
    asyncio.run(main(p.parse_args()))
