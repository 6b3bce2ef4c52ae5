"""The drafter interface: a drafter proposes a few tokens to follow each decoding request's sequence; one forward
pass of the target model then verifies them (engine/spec/verify.py). Drafters hold no pages and write no request
field; one with per-request state (an index, a draft model's KV) drops it in ``release``."""
from __future__ import annotations

from abc import ABC, abstractmethod

from engine.request import Request


class Drafter(ABC):
    name: str

    @abstractmethod
    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        """Draft tokens for each request, at most ``limits[i]`` for ``reqs[i]`` (possibly none), to follow its
        prompt and output so far. A drafter proposes one token per position (a chain); the verifier accepts the
        longest prefix the target agrees with."""

    def release(self, req: Request) -> None:
        """The request left the engine: forget what was kept for it."""
