"""Request state as the scheduler and the runner see it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Abort:
    """Why a request was aborted, and the HTTP status a client that is still listening should get."""

    status: int
    message: str
    code: str = "request_aborted"  # "request_failed": this request caused it (routers neither retry nor blame)


@dataclass(frozen=True)
class KVTicket:
    """Where a request's KV goes to or comes from outside this engine: an id both ends agree on and, for the
    receiving end, the sending peer's address. The engine only carries it; the worker role that set it reads it."""

    id: int
    host: str | None = None
    port: int | None = None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int  # resolved against the context length
    extra_key: str | None = None
    priority: int = 0
    group_leader: Request | None = None  # n > 1: siblings wait until the leader's prompt is cached
    seed: int | None = None  # per-choice seed (sampling.seed mixed with the choice index)
    arrival: float = field(default_factory=time.monotonic)

    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    finish_detail: Any = None  # the stop string or token that ended it, or the abort reason

    # KV bookkeeping (owned by the scheduler's KVManager)
    pages: list[int] = field(default_factory=list)
    num_cached_pages: int = 0  # leading pages owned by the prefix cache (locked through ``node``)
    node: Any = None
    kv_len: int = 0  # tokens whose K/V are in the pool
    prefill_done: bool = False
    hold_kv: bool = False  # a transfer uses the pages: keep them after finishing until released
    kv_ticket: KVTicket | None = None  # set by a worker role's prepare hook when the KV travels
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    retractions: int = 0
    prefix_loads: int = 0  # HiCache load-backs started for it

    # timing (monotonic seconds)
    first_token_time: float | None = None
    last_token_time: float | None = None

    # filled by other components
    detok: Any = None
    grammar: Any = None  # a GrammarState: the output so far, as the request's grammar has accepted it
    output_logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs: list[Any] = field(default_factory=list)  # entry j: prompt token j + 1 (echo with logprobs)

    def tokens(self, start: int, end: int) -> list[int]:
        """(prompt_ids + output_ids)[start:end] without building the joined list."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.seq_len - self.kv_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
