"""What one engine step runs: for each request, which token positions to compute and whether to sample."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine.request import Request


class StepRecord(NamedTuple):
    """One engine step as metrics see it: its time and the tokens it computed."""
    seconds: float
    prefill_tokens: int  # prompt positions (chunks of prefills and extends)
    decode_tokens: int  # one per decoding request, plus its verified draft tokens

    @property
    def kind(self) -> str:
        return "mixed" if self.prefill_tokens and self.decode_tokens else "prefill" if self.prefill_tokens \
            else "decode"


@dataclass(frozen=True)
class ScheduledSeq:
    req: Request
    start: int  # first position computed this step (the request's kv_len)
    num_tokens: int
    sample: bool  # the chunk reaches the end of the sequence, so its last position is sampled
    # speculative decoding: tokens proposed to follow the sequence, computed after its newest token
    # (num_tokens = 1 + len(draft)); every one of those positions is sampled to verify them
    draft: tuple[int, ...] = ()
    # a tree draft's parent of each draft token (-1: the newest token; engine/spec/tree.py); () for a chain
    parents: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def sampled(self) -> list[ScheduledSeq]:
        return [s for s in self.seqs if s.sample]

    @property
    def num_decode(self) -> int:
        return sum(1 for s in self.seqs if s.num_tokens == 1 or s.draft)

    def record(self, seconds: float) -> StepRecord:
        decode = sum(s.num_tokens for s in self.seqs if s.num_tokens == 1 or s.draft)
        return StepRecord(seconds, self.num_tokens - decode, decode)
