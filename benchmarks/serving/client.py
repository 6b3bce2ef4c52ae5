"""One streamed request and its timings. Every request goes to the configured base URL only. TTFT is the time
to the first chunk that carries output, ITL the gaps between later output chunks, E2E the time to the end of
the stream. Token counts come from the server (OpenAI usage, /generate meta_info); the source is recorded."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks.serving.config import TargetConfig
from benchmarks.serving.text import TextMaker
from benchmarks.serving.workloads import Item, render_messages, render_prompt

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}
MAX_ERROR_BODY = 2000


@dataclass
class RequestRecord:
    item: int
    turn: int
    tag: str
    planned_output: int
    start: float = 0.0  # seconds from the phase start to sending
    ok: bool = False
    error: str | None = None  # kind: http_STATUS, stream_error:CODE, timeout, connection_error, ...
    error_message: str | None = None
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    tokens_source: str | None = None
    text: str = ""
    sent: bool = False

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def fail(self, kind: str, message: str, status: int | None = None) -> None:
        self.ok, self.error, self.error_message, self.status = False, kind, message[:MAX_ERROR_BODY], status

    def to_json(self) -> dict[str, Any]:
        return {"item": self.item, "turn": self.turn, "tag": self.tag, "start_s": self.start, "ok": self.ok,
                "error": self.error, "error_message": self.error_message, "status": self.status,
                "ttft_s": self.ttft, "e2e_s": self.e2e, "tpot_s": self.tpot, "itl_s": self.itl,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "planned_output_tokens": self.planned_output, "cached_tokens": self.cached_tokens,
                "tokens_source": self.tokens_source}


class _Stream:
    """Parses one SSE response body of the chosen backend into output events and final counts."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.text = ""
        self.events = 0
        self.ids_seen = 0
        self.usage: dict[str, Any] | None = None
        self.meta: dict[str, Any] | None = None
        self.done = False

    def feed(self, obj: dict[str, Any]) -> bool:
        """Take one data object; True when it carried new output."""
        if obj.get("usage"):
            self.usage = obj["usage"]
        if self.backend == "generate":
            self.meta = obj.get("meta_info") or self.meta
            ids = obj.get("output_ids")
            new = len(ids) - self.ids_seen if isinstance(ids, list) else 0
            if isinstance(ids, list):
                self.ids_seen = len(ids)
            text = obj.get("text")
            if isinstance(text, str):
                self.text = text
            return new > 0 or (ids is None and bool(text))
        choices = obj.get("choices") or []
        piece = ""
        for ch in choices:
            part = (ch.get("delta") or {}).get("content") if self.backend == "chat" else ch.get("text")
            piece += part or ""
        self.text += piece
        return bool(piece)


class Client:
    def __init__(self, target: TargetConfig, model: str | None, tm: TextMaker) -> None:
        self.target = target
        self.model = model
        self.tm = tm
        self.url = target.base_url.rstrip("/") + PATHS[target.backend]
        self.headers = {"Content-Type": "application/json", **target.auth_headers}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.target.request_timeout),
            connector=aiohttp.TCPConnector(limit=0, force_close=False), read_bufsize=1 << 20)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def payload(self, item: Item, turn: int, answers: list[str]) -> dict[str, Any]:
        t = item.turns[turn]
        extra = {"ignore_eos": True} if self.target.ignore_eos else {}
        if self.target.backend == "generate":
            return {"text": render_prompt(item, turn, answers), "stream": True,
                    "sampling_params": {"max_new_tokens": t.output_len, "temperature": self.target.temperature,
                                        **extra}}
        body: dict[str, Any] = {"max_tokens": t.output_len, "temperature": self.target.temperature,
                                "stream": True, "stream_options": {"include_usage": True}, **extra}
        if self.model:
            body["model"] = self.model
        if self.target.backend == "chat":
            body["messages"] = render_messages(item, turn, answers)
        else:
            body["prompt"] = render_prompt(item, turn, answers)
        return body

    async def send(self, rec: RequestRecord, body: dict[str, Any], phase_t0: float) -> None:
        """Send ``body`` and fill ``rec``; never raises for a failed request (cancellation passes through)."""
        assert self._session is not None, "use Client as an async context manager"
        t0 = time.perf_counter()
        rec.start, rec.sent = t0 - phase_t0, True
        try:
            async with self._session.post(self.url, json=body, headers=self.headers) as resp:
                rec.status = resp.status
                if resp.status != 200:
                    raw = await resp.content.read(MAX_ERROR_BODY)
                    rec.fail(f"http_{resp.status}", _error_message(raw), resp.status)
                    return
                await self._read_stream(resp, rec, t0)
        except asyncio.TimeoutError:
            rec.fail("timeout", f"no complete answer within --request-timeout {self.target.request_timeout}s")
        except aiohttp.ClientConnectorError as e:
            rec.fail("connection_error", str(e))
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            rec.fail("connection_lost", f"{type(e).__name__}: {e}")
        except aiohttp.ClientError as e:
            rec.fail("client_error", f"{type(e).__name__}: {e}")

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float) -> None:
        stream = _Stream(self.target.backend)
        last: float | None = None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                stream.done = True
                break
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                rec.fail("bad_response", f"not JSON in the stream: {data[:200]!r}", resp.status)
                return
            if not isinstance(obj, dict):
                rec.fail("bad_response", f"stream event is not an object: {data[:200]!r}", resp.status)
                return
            if "error" in obj:
                err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
                rec.fail(f"stream_error:{err.get('code') or err.get('type') or 'unknown'}",
                         str(err.get("message")), resp.status)
                return
            if stream.feed(obj):
                now = time.perf_counter()
                if last is None:
                    rec.ttft = now - t0
                else:
                    rec.itl.append(now - last)
                last = now
        rec.e2e = time.perf_counter() - t0
        rec.text = stream.text
        if not stream.done:
            rec.fail("incomplete_stream", "the stream ended without 'data: [DONE]'", resp.status)
            return
        self._counts(rec, stream)
        rec.ok = True

    def _counts(self, rec: RequestRecord, s: _Stream) -> None:
        if s.usage is not None:
            rec.prompt_tokens = s.usage.get("prompt_tokens")
            rec.output_tokens = s.usage.get("completion_tokens")
            rec.cached_tokens = (s.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            rec.tokens_source = "usage"
        elif s.meta is not None and "completion_tokens" in s.meta:
            rec.prompt_tokens = s.meta.get("prompt_tokens")
            rec.output_tokens = s.meta.get("completion_tokens")
            rec.cached_tokens = s.meta.get("cached_tokens")
            rec.tokens_source = "meta_info"
        elif self.tm.tokenizer is not None:
            rec.output_tokens = self.tm.count(s.text)
            rec.tokens_source = "tokenizer"
        else:
            rec.output_tokens = s.ids_seen or (len(rec.itl) + (rec.ttft is not None))
            rec.tokens_source = "chunks"

    async def get_json(self, path: str) -> Any:
        assert self._session is not None
        async with self._session.get(self.target.base_url.rstrip("/") + path, headers=self.headers,
                                     timeout=aiohttp.ClientTimeout(total=10)) as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)

    async def post_json(self, path: str, body: dict[str, Any] | None = None) -> Any:
        assert self._session is not None
        async with self._session.post(self.target.base_url.rstrip("/") + path, json=body or {},
                                      headers=self.headers, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)


def _error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            return str(obj["error"].get("message"))
        if isinstance(obj, dict) and "detail" in obj:
            return str(obj["detail"])
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    return raw.decode("utf-8", "replace")
