"""The bootstrap fields a router adds to a request in PD mode (``bootstrap_host``, ``bootstrap_port``,
``bootstrap_room``), checked and turned into the room each engine request's KV travels through.

A body with several prompts may carry one room per prompt (a list) or one room; the c-th choice of prompt p
uses ``room(p) + c`` (mod 2**63), so prefill and decode, given the same body, derive the same rooms."""
from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request
from engine.sampling_params import InvalidRequestError
from engine.server.protocol import MAX_N, RoutingFields

ROOM_MASK = (1 << 63) - 1
HINT = "send requests through launch_router --pd-disaggregation, which adds them"


@dataclass
class PDRoom:
    room: int
    host: str | None
    port: int | None


def room_for(body: RoutingFields, prompt_index: int, choice: int, role: str) -> int:
    raw = body.bootstrap_room
    if raw is None:
        raise InvalidRequestError(f"this is a {role} worker: the request needs bootstrap_room ({HINT})",
                                  param="bootstrap_room", code="missing_bootstrap")
    base = raw[prompt_index] if isinstance(raw, list) else raw
    if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base <= ROOM_MASK:
        raise InvalidRequestError(f"bootstrap_room must be an integer in [0, 2**63), got {base!r}",
                                  param="bootstrap_room")
    # One room per (prompt, choice). A list gives each prompt its own base; one value for a batch (the router's
    # form for /v1/completions) is spread over the prompts, both workers deriving the same rooms from the body.
    offset = choice if isinstance(raw, list) else prompt_index * MAX_N + choice
    return (base + offset) & ROOM_MASK


def _single(value: object, prompt_index: int) -> object:
    return value[prompt_index] if isinstance(value, list) else value


def prefill_prepare(req: Request, body: RoutingFields, prompt_index: int, choice: int) -> None:
    """Prefill role: the room is enough (host and port name this worker itself)."""
    req.pd = PDRoom(room_for(body, prompt_index, choice, "prefill"), None, None)


def decode_prepare(req: Request, body: RoutingFields, prompt_index: int, choice: int) -> None:
    """Decode role: the prefill worker's bootstrap address is needed too."""
    host, port = _single(body.bootstrap_host, prompt_index), _single(body.bootstrap_port, prompt_index)
    if not isinstance(host, str) or not host:
        raise InvalidRequestError(f"this is a decode worker: the request needs bootstrap_host ({HINT})",
                                  param="bootstrap_host", code="missing_bootstrap")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise InvalidRequestError(f"this is a decode worker: the request needs bootstrap_port, the prefill "
                                  f"worker's bootstrap port, got {port!r} ({HINT})", param="bootstrap_port",
                                  code="missing_bootstrap")
    req.pd = PDRoom(room_for(body, prompt_index, choice, "decode"), host, port)
