"""What speculation costs, timed once at load, so that the speculator's first steps are decided on measured costs
rather than on none (it used to draft for every request until it had seen what drafted steps cost).

``time_step`` runs the model over scratch pages for a few step shapes: ``batch`` sequences of ``CONTEXT`` tokens
each, every one computing ``rows_each`` positions (1 for plain decoding, 1 + k for a verification of k drafts). The
shapes are batch 1 and 4, plain and verified, for the target; one draft forward at batch 1 and 4 for a draft model.
The shapes take turns, one round to warm up and then ``REPEATS`` rounds; the fastest of each is kept (a 2-core
host's noise only ever adds time). The pages go back to the pool before the engine serves anything; their K/V are
left as scratch.

``CostPrior.best_gain`` is the most speculation could ever gain at batch 1: every one of k drafts accepted, k
draft forwards and one verification against k + 1 plain steps. Below 1 the drafter cannot pay even then (a
draft model that costs what the target costs: SmolLM2 drafting for itself in bfloat16 measured 0.85-0.92x of
plain decoding at batch 4 and 16 when it was tried cold), and the speculator probes it only rarely. Measured on
SmolLM2 (2 cores, AMD EPYC): the prior takes 0.3-0.6 s at load."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from engine.mem.allocator import PageAllocator
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.batch import ScheduledBatch, ScheduledSeq
from engine.scheduler.kv_manager import pages_for

CONTEXT = 128  # tokens of context each timed sequence attends over (a short chat's decode)
BATCHES = (1, 4)  # the batch sizes timed
REPEATS = 3  # timed runs per shape after one warm-up; the fastest is kept
_PLAIN = SamplingParams()


@dataclass(frozen=True)
class CostPrior:
    target: dict[int, float]  # rows of a target step -> seconds
    draft: dict[int, float]  # requests in one draft forward -> seconds (empty: the drafter costs no forwards)
    k: int  # the draft length the verified shapes were timed with
    catch_up: float = 0.0  # the drafter's seconds per token of a request it has not read yet (Drafter.time_catch_up)

    def best_gain(self) -> float | None:
        """Tokens per second at batch 1 with all k drafts accepted, over plain decoding's (None: not timed)."""
        plain, verify = self.target.get(1), self.target.get(1 + self.k)
        if not plain or not verify:
            return None
        drafting = self.k * self.draft.get(1, 0.0)
        return (1 + self.k) * plain / (drafting + verify)


def time_step(forward: Callable[[ScheduledBatch], object], allocator: PageAllocator, page_size: int, batch: int,
              rows_each: int) -> float | None:
    """Seconds of one ``forward`` over ``batch`` scratch sequences computing ``rows_each`` positions each at the
    end of ``CONTEXT`` tokens (rows past the first as draft tokens), or None where the pool lacks the pages."""
    length = CONTEXT + rows_each
    need = pages_for(length, page_size)
    if need * batch > allocator.available:
        return None
    seqs = []
    for i in range(batch):
        req = Request(f"spec-prior-{i}", [0] * length, _PLAIN, 1)  # token 0 exists in every vocabulary
        req.pages = allocator.alloc(need) or []
        seqs.append(ScheduledSeq(req, CONTEXT, rows_each, True, tuple(req.prompt_ids[CONTEXT + 1:length])))
    try:
        start = time.perf_counter()
        forward(ScheduledBatch(seqs))
        if torch.cuda.is_initialized():  # kernels run asynchronously: time them, not their launch
            torch.cuda.synchronize()
        return time.perf_counter() - start
    finally:
        for s in seqs:
            allocator.free(s.req.pages)
            s.req.pages = []


def time_extend(forward: Callable[[ScheduledBatch], object], allocator: PageAllocator, page_size: int,
                tokens: int) -> float:
    """The fastest of ``REPEATS`` forwards (after one untimed) computing one scratch prompt of ``tokens`` tokens
    from its start, as a prefill chunk; 0.0 where the pool lacks the pages."""
    need = pages_for(tokens, page_size)
    if need > allocator.available:
        return 0.0
    req = Request("spec-prior-extend", [0] * tokens, _PLAIN, 1)
    req.pages = allocator.alloc(need) or []
    try:
        best = float("inf")
        for attempt in range(1 + REPEATS):
            start = time.perf_counter()
            forward(ScheduledBatch([ScheduledSeq(req, 0, tokens, True)]))
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            if attempt:
                best = min(best, time.perf_counter() - start)
        return best
    finally:
        allocator.free(req.pages)
        req.pages = []


def time_shapes(forward: Callable[[ScheduledBatch], object], allocator: PageAllocator, page_size: int,
                shapes: Iterable[tuple[int, int]]) -> dict[int, float]:
    """Total rows -> fastest seconds for each (batch, rows per sequence) shape that fits the pool. The shapes
    take turns, a round to warm up and then ``REPEATS`` timed rounds (the first call of a shape can take 1.4x
    the next: bfloat16 SmolLM2 at one row, 16.9 ms against 12.3), so a noisy moment spreads over all of them."""
    shapes = list(shapes)
    best: dict[int, float] = {}
    for attempt in range(1 + REPEATS):
        for batch, rows_each in shapes:
            seconds = time_step(forward, allocator, page_size, batch, rows_each)
            if seconds is not None and attempt:
                best[batch * rows_each] = min(best.get(batch * rows_each, float("inf")), seconds)
    return best


def target_shapes(k: int) -> list[tuple[int, int]]:
    """Plain decoding and a verification of ``k`` drafts, at each timed batch size."""
    return [(b, rows) for b in BATCHES for rows in (1, 1 + k)]


def measure(forward: Callable[[ScheduledBatch], object], allocator: PageAllocator, page_size: int, k: int,
            draft: dict[int, float], catch_up: float = 0.0) -> CostPrior:
    """The prior for a target whose step is ``forward``, with ``draft`` and ``catch_up`` the drafter's own
    timings (``Drafter.time_forward``, ``Drafter.time_catch_up``)."""
    return CostPrior(time_shapes(forward, allocator, page_size, target_shapes(k)), draft, k, catch_up)
