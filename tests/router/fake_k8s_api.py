"""A small fake Kubernetes API server for the router's discovery tests (no cluster can run
here). It serves `GET /api/v1/namespaces/{ns}/pods` as a PodList (with `labelSelector`) and,
with `watch=true`, as a stream of JSON-line watch events (ADDED / MODIFIED / DELETED) until
`timeoutSeconds`. Tests change pods through `POST /_pod` (upsert), `DELETE /_pod/{name}`, and
`POST /_drop_watches` (close every open watch); `GET /_stats` counts lists and watches.

Run: python tests/router/fake_k8s_api.py --port P
"""
from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from aiohttp import web


class FakeApi:
    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 1
        self.watchers: list[tuple[dict[str, str], asyncio.Queue[dict[str, Any] | None]]] = []
        self.lists = 0
        self.watches = 0

    @staticmethod
    def selector(q: str) -> dict[str, str]:
        return dict(kv.split("=", 1) for kv in q.split(",") if kv)

    @staticmethod
    def matches(pod: dict[str, Any], sel: dict[str, str]) -> bool:
        labels = pod["metadata"].get("labels", {})
        return all(labels.get(k) == v for k, v in sel.items())

    def emit(self, kind: str, pod: dict[str, Any]) -> None:
        for sel, q in self.watchers:
            if self.matches(pod, sel):
                q.put_nowait({"type": kind, "object": pod})

    async def pods_h(self, req: web.Request) -> web.StreamResponse:
        sel = self.selector(req.query.get("labelSelector", ""))
        if req.query.get("watch") != "true":
            self.lists += 1
            items = [p for p in self.pods.values() if self.matches(p, sel)]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.rv)}, "items": items})
        self.watches += 1
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(req)
        q: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        entry = (sel, q)
        self.watchers.append(entry)
        timeout = float(req.query.get("timeoutSeconds", "30"))
        try:
            while True:
                ev = await asyncio.wait_for(q.get(), timeout)
                if ev is None:
                    break
                await resp.write(json.dumps(ev).encode() + b"\n")
        except asyncio.TimeoutError:
            pass
        finally:
            self.watchers.remove(entry)
        await resp.write_eof()
        return resp

    async def upsert(self, req: web.Request) -> web.Response:
        spec = await req.json()
        name = spec["name"]
        self.rv += 1
        pod = {
            "metadata": {"name": name, "namespace": spec.get("namespace", "default"), "labels": spec.get("labels", {}),
                         "annotations": spec.get("annotations", {}), "resourceVersion": str(self.rv)},
            "status": {"phase": spec.get("phase", "Running"), "podIP": spec.get("ip", ""),
                       "conditions": [{"type": "Ready", "status": "True" if spec.get("ready", True) else "False"}]},
        }
        kind = "MODIFIED" if name in self.pods else "ADDED"
        self.pods[name] = pod
        if spec.get("notify", True):
            self.emit(kind, pod)
        return web.json_response({"event": kind})

    async def delete(self, req: web.Request) -> web.Response:
        pod = self.pods.pop(req.match_info["name"])
        self.rv += 1
        if req.query.get("notify", "true") == "true":
            self.emit("DELETED", pod)
        return web.json_response({"event": "DELETED"})

    async def drop(self, req: web.Request) -> web.Response:
        for _, q in list(self.watchers):
            q.put_nowait(None)
        return web.json_response({"dropped": len(self.watchers)})

    async def stats(self, req: web.Request) -> web.Response:
        return web.json_response({"lists": self.lists, "watches": self.watches, "open_watches": len(self.watchers)})


async def main(port: int) -> None:
    api = FakeApi()
    app = web.Application()
    app.router.add_get("/api/v1/namespaces/{ns}/pods", api.pods_h)
    app.router.add_post("/_pod", api.upsert)
    app.router.add_delete("/_pod/{name}", api.delete)
    app.router.add_post("/_drop_watches", api.drop)
    app.router.add_get("/_stats", api.stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    asyncio.run(main(p.parse_args().port))
