"""An endpoint the interpreter talks to: a SplitServe colocated server or router (``/tokenize``, ``/generate``,
``/v1/completions`` with prompt logprobs). Everything is token ids: a ``gen`` sends the state's exact ids and
appends the ids the server produced, so nothing is re-tokenized and every shared prefix is a cache hit."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from frontend.errors import ServerError, UnsupportedError

SENTINEL = "@@SPLITSERVE_FRONTEND_SENTINEL@@"


class Endpoint:
    """A SplitServe server or router: token-exact continuations."""

    token_exact = True

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self._lock = threading.Lock()
        self._tokens: dict[str, list[int]] = {}
        self._roles: dict[str, tuple[str, str]] = {}
        self._model: str | None = None

    # -- plumbing ----------------------------------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any], site: str) -> Any:
        try:
            r = self._http.post(path, json=body)
        except httpx.HTTPError as e:
            raise ServerError(f"{type(e).__name__}: {e}", status=0, site=site) from None
        if r.status_code >= 400:
            self._raise(r, site)
        return r.json()

    @staticmethod
    def _raise(r: httpx.Response, site: str) -> None:
        try:
            err = r.json().get("error", {})
        except ValueError:
            err = {"message": r.text[:500]}
        raise ServerError(str(err.get("message")), status=r.status_code, site=site, param=err.get("param"),
                          code=err.get("code"))

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self._http.get("/v1/models").json()["data"][0]["id"]
        return self._model

    # -- what the interpreter needs ------------------------------------------------------------------------------
    def tokenize(self, text: str, site: str = "tokenize") -> list[int]:
        """The ids of ``text`` alone (no special tokens added; the template's own markers are parsed)."""
        with self._lock:
            hit = self._tokens.get(text)
        if hit is not None:
            return hit
        ids = self._post("/tokenize", {"prompt": text, "add_special_tokens": False}, site)["tokens"]
        with self._lock:
            if len(self._tokens) < 4096:
                self._tokens[text] = ids
        return ids

    def role_markers(self, role: str, site: str) -> tuple[str, str]:
        """The text the chat template puts before and after one message of ``role``, found by rendering a message
        holding a sentinel after a system message (so no default system prompt is added)."""
        with self._lock:
            hit = self._roles.get(role)
        if hit is not None:
            return hit
        base = [{"role": "system", "content": "x"}]
        messages = [{"role": role, "content": SENTINEL}] if role == "system" else base + [
            {"role": role, "content": SENTINEL}]
        whole = self._render(messages, site)
        before = "" if role == "system" else self._render(base, site)
        if not whole.startswith(before) or SENTINEL not in whole:
            raise ServerError(f"the chat template does not render a {role!r} message as plain text around its "
                              "content", status=0, site=site)
        prefix, suffix = whole[len(before):].split(SENTINEL, 1)
        with self._lock:
            self._roles[role] = (prefix, suffix)
        return prefix, suffix

    def _render(self, messages: list[dict[str, str]], site: str) -> str:
        out = self._post("/tokenize", {"messages": messages, "add_generation_prompt": False,
                                       "return_token_strs": True}, site)
        return "".join(out["token_strs"])

    def generate(self, ids: list[int], params: dict[str, Any], site: str, text: str = "") -> dict[str, Any]:
        return self._post("/generate", {"input_ids": ids, "sampling_params": params}, site)

    def generate_stream(self, ids: list[int], params: dict[str, Any], site: str,
                        text: str = "") -> Iterator[tuple[str, Any]]:
        """("text", new text) as it is generated, then ("done", the last chunk: text, output_ids, meta_info)."""
        body = {"input_ids": ids, "sampling_params": params, "stream": True}
        try:
            with self._http.stream("POST", "/generate", json=body) as r:
                if r.status_code >= 400:
                    r.read()
                    self._raise(r, site)
                seen, last = "", None
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        err = chunk["error"]
                        raise ServerError(str(err.get("message")), status=500, site=site, code=err.get("code"))
                    if chunk["text"] != seen:
                        yield "text", chunk["text"][len(seen):]
                        seen = chunk["text"]
                    last = chunk
        except httpx.HTTPError as e:
            raise ServerError(f"{type(e).__name__}: {e}", status=0, site=site) from None
        if last is None:
            raise ServerError("the stream ended before any result", status=0, site=site)
        yield "done", last

    def continuation_logprobs(self, ids: list[int], choices: list[list[int]], site: str) -> list[list[float]]:
        """For each choice, the log-probabilities of its tokens after ``ids``, in one request (the prompt
        logprobs of every prefix + choice, max_tokens 0)."""
        out = self._post("/v1/completions", {"model": self.model, "prompt": [ids + c for c in choices],
                                             "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}, site)
        by_index = sorted(out["choices"], key=lambda c: c["index"])
        return [c["logprobs"]["token_logprobs"][len(ids):] for c in by_index]

    def close(self) -> None:
        self._http.close()


class OpenAICompatible(Endpoint):
    """Any OpenAI-compatible server (vLLM, a hosted API), for programs of text, ``gen`` and ``fork``: prompts go
    to ``/v1/completions`` as text, so prefix reuse is whatever that server's own caching makes of it. Role
    blocks (they need the model's chat template) and ``select`` (it needs prompt logprobs of token ids) are
    refused; use Endpoint with a SplitServe server for those."""

    token_exact = False
    _FIELDS = {"max_new_tokens": "max_tokens", "sampling_seed": "seed"}

    def __init__(self, url: str, model: str, *, api_key: str | None = None, timeout: float = 600.0) -> None:
        super().__init__(url, api_key=api_key, timeout=timeout)
        self._model = model

    def tokenize(self, text: str, site: str = "tokenize") -> list[int]:
        return []

    def role_markers(self, role: str, site: str) -> tuple[str, str]:
        raise UnsupportedError(f"{site}: a {role}() block needs the served model's chat template; use Endpoint "
                               "with a SplitServe server")

    def continuation_logprobs(self, ids: list[int], choices: list[list[int]], site: str) -> list[list[float]]:
        raise UnsupportedError(f"{site}: select() needs prompt logprobs of token ids; use Endpoint with a "
                               "SplitServe server")

    def generate(self, ids: list[int], params: dict[str, Any], site: str, text: str = "") -> dict[str, Any]:
        body = {"model": self.model, "prompt": text, **{self._FIELDS.get(k, k): v for k, v in params.items()}}
        out = self._post("/v1/completions", body, site)
        choice = out["choices"][0]
        usage = out.get("usage") or {}
        return {"text": choice["text"], "output_ids": [], "meta_info": {
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "finish_reason": {"type": choice.get("finish_reason")}}}

    def generate_stream(self, ids: list[int], params: dict[str, Any], site: str,
                        text: str = "") -> Iterator[tuple[str, Any]]:
        out = self.generate(ids, params, site, text)
        yield "text", out["text"]
        yield "done", out
