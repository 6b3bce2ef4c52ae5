"""Small HTTP calls the launchers make to workers and the router (standard library only: the launchers must not
need the test extras)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET ``url``, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, ValueError):
        return None


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def send_json(method: str, url: str, body: Any, timeout: float = 10.0) -> tuple[int, Any]:
    """``method`` ``url`` with a JSON body; returns (status, decoded JSON or None). Raises OSError when nothing
    answered."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, _decode(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, _decode(e.read())


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def router_workers(router_url: str) -> list[dict]:
    """``GET /workers`` of the router: [{url, role, healthy, ...}]."""
    return list(get_json(router_url + "/workers")["workers"])


def served_model(router_url: str) -> str | None:
    try:
        models = get_json(router_url + "/v1/models")["data"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return models[0]["id"] if models else None


def first_completion(router_url: str, model: str, timeout: float = 120.0) -> tuple[int | None, str]:
    """One-token completion through the router: the whole path (pairing, KV handshake, transfer, decode) works
    once this succeeds. Returns (status or None, the error text)."""
    try:
        code, body = send_json("POST", router_url + "/v1/completions",
                               {"model": model, "prompt": "warm-up", "max_tokens": 1}, timeout=timeout)
    except OSError as e:
        return None, str(e)
    message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
    return code, message
