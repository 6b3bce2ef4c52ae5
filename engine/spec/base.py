"""The drafter interface: a drafter proposes a few tokens to follow each decoding request's sequence; one forward
pass of the target model then verifies them (engine/spec/verify.py). Drafters hold none of the target's pages and
write no request field; one with per-request state (an index, a draft model's KV) drops it in ``release``. A
drafter with a KV pool of its own states its size per token, so the engine splits one memory budget between the
two pools, and gets its pool (as many tokens as the target's) from ``allocate``."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.request import Request
from engine.spec.tree import DraftTree


class Drafter(ABC):
    name: str
    kv_bytes_per_token: int = 0  # the drafter's own KV bytes per token of a sequence (0: it keeps no KV)
    # EAGLE-style drafters read the target's features: with this set the target's runner keeps the final hidden
    # state of every row it computes and ``observe_hidden`` gets each request's, position by position
    wants_hidden_states: bool = False
    # seconds the last proposal spent drafting proper, when it also did other work (a draft model catching up on
    # a prompt); None: the whole proposal is drafting
    draft_seconds: float | None = None

    @abstractmethod
    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int] | DraftTree]:
        """Draft tokens for each request, at most ``limits[i]`` positions deep for ``reqs[i]`` (possibly none), to
        follow its prompt and output so far: a chain (a list, one token per position; the verifier accepts the
        longest prefix the target agrees with) or a token tree (engine/spec/tree.py: several candidates where
        they branch; the verifier follows the branch the target agrees with; a chain with evidence attached is
        ``DraftTree.chain(tokens, evidence)``, and the speculator learns acceptance per evidence)."""

    def allocate(self, num_tokens: int, page_size: int) -> None:
        """Build the drafter's KV pool for ``num_tokens`` tokens (called once, before the first proposal)."""

    def time_forward(self) -> dict[int, float]:
        """Seconds of one draft forward by the number of requests in it, timed once at load (after
        ``allocate``; engine/spec/prior.py); empty for a drafter that runs no model."""
        return {}

    def time_catch_up(self) -> float:
        """Seconds per token to read a request's tokens the drafter has not seen (a draft model prefilling a
        prompt), timed once at load; 0 for a drafter that needs no such reading."""
        return 0.0

    def pending_tokens(self, req: Request) -> int:
        """Tokens of ``req`` (prompt and output) the drafter has not read yet: what its next proposals for it
        must catch up on before they can draft."""
        return 0

    def observe_hidden(self, req: Request, start: int, hidden: torch.Tensor) -> None:
        """(``wants_hidden_states``) The target's final hidden states (after its last norm, before its LM head) of
        ``req``'s positions ``start``, ``start + 1``, ...: of every prompt chunk and decode as it is computed, and
        of a verification the newest token's and its accepted drafts' (rejected drafts never arrive). Row p is
        the feature that predicted token p + 1, which an EAGLE head reads with that token."""

    def release(self, req: Request) -> None:
        """The request left the engine: forget what was kept for it."""

    def check_integrity(self) -> None:
        """Raise unless the drafter's own pages are each free or held by exactly one live request."""
