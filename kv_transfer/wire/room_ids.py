"""The room of each engine request of a PD body, and the sending peer's address, from the bootstrap fields a router
adds (``bootstrap_room``, ``bootstrap_host``, ``bootstrap_port``; ARCHITECTURE.md).

A body with several prompts carries one room per prompt (a list) or one room; choice c of prompt p uses
``room(p) + c`` for a list and ``room + p * stride + c`` for one room (mod 2**63; ``stride``: the most choices a
prompt may ask for), so prefill and decode, given the same body, derive the same rooms."""
from __future__ import annotations

ROOM_MASK = (1 << 63) - 1
HINT = "send requests through launch_router --pd-disaggregation, which adds them"


class BootstrapFieldError(ValueError):
    """The body's bootstrap fields name no usable room or peer; ``field`` is the one to fix, ``missing`` whether
    it was absent (the request did not come through a PD router)."""

    def __init__(self, message: str, field: str, missing: bool) -> None:
        super().__init__(message)
        self.field, self.missing = field, missing


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def room_id(raw: object, prompt_index: int, choice: int, stride: int) -> int:
    if raw is None:
        raise BootstrapFieldError(f"the request needs bootstrap_room ({HINT})", "bootstrap_room", True)
    base = raw[prompt_index] if isinstance(raw, list) else raw
    if not _int(base) or not 0 <= base <= ROOM_MASK:  # type: ignore[operator]
        raise BootstrapFieldError(f"bootstrap_room must be an integer in [0, 2**63), got {base!r}", "bootstrap_room",
                                  False)
    offset = choice if isinstance(raw, list) else prompt_index * stride + choice
    return (base + offset) & ROOM_MASK  # type: ignore[operator]


def peer_address(host: object, port: object, prompt_index: int) -> tuple[str, int]:
    """The prefill worker's bootstrap address for prompt ``prompt_index`` (each field one value or one per prompt)."""
    host = host[prompt_index] if isinstance(host, list) else host
    port = port[prompt_index] if isinstance(port, list) else port
    if not isinstance(host, str) or not host:
        raise BootstrapFieldError(f"the request needs bootstrap_host ({HINT})", "bootstrap_host", True)
    if not _int(port) or not 0 < port < 65536:  # type: ignore[operator]
        raise BootstrapFieldError(f"the request needs bootstrap_port, the prefill worker's bootstrap port, got "
                                  f"{port!r} ({HINT})", "bootstrap_port", True)
    return host, port  # type: ignore[return-value]
