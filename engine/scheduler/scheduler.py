"""The scheduler: ``schedule()`` picks what the next step computes, ``update()`` applies its sampled tokens.

Every running request computes ``fill_ids[kv_len:]``: a decode is the case of one remaining token; a prefill
is cut into chunks of at most ``chunked_prefill_size`` and shares a per-step token budget. Decodes go first, so
a long prompt never stalls running streams. Admission allocates a request's pages up front; decode pages are
added at page boundaries, and when memory runs out the newest request is retracted (its pages released, the
request requeued with its output so far) so older ones can finish."""
from __future__ import annotations

from collections import deque

from engine.config import SchedulerConfig
from engine.mem.allocator import PageAllocator
from engine.mem.base import PrefixCache
from engine.request import Abort, Request, Status
from engine.scheduler.batch import ScheduledBatch, ScheduledSeq
from engine.scheduler.kv_manager import KVManager
from engine.scheduler.policy import order_waiting


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: PageAllocator, cache: PrefixCache, page_size: int,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.cfg = cfg
        self.kv = KVManager(allocator, cache, page_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order (oldest first)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_retractions = 0

    # -- queue management --------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def abort(self, rid: str, reason: Abort) -> Request | None:
        """Remove the request wherever it is and release its pages; returns it (finished) or None."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, "abort", reason, release=False)
                return req
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._finish(req, "abort", reason)
                return req
        return None

    def finish(self, req: Request, reason: str, detail: object = None) -> None:
        """End a running request for a reason found outside the scheduler (e.g. a stop string)."""
        if req in self.running:
            self.running.remove(req)
            self._finish(req, reason, detail)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling --------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        self._reserve_decode_pages()
        seqs: list[ScheduledSeq] = []
        budget = self.cfg.max_prefill_tokens
        for req in self.running:
            if req.remaining == 1:
                seqs.append(ScheduledSeq(req, req.kv_len, 1, True))
        for req in self.running:
            if req.remaining > 1 and budget > 0:
                n = self._chunk(req.remaining, budget, first=budget == self.cfg.max_prefill_tokens)
                seqs.append(ScheduledSeq(req, req.kv_len, n, n == req.remaining))
                budget -= n
        budget = self._admit(seqs, budget)
        return ScheduledBatch(seqs) if seqs else None

    def _chunk(self, remaining: int, budget: int, first: bool) -> int:
        """Tokens of a prefill to run this step; ``first`` means no other prefill is in the step yet."""
        chunk = self.cfg.chunk_size
        if chunk is None:  # no chunking: the whole prompt, even beyond the budget if it is the step's only one
            return remaining if (remaining <= budget or first) else 0
        return min(remaining, chunk, budget)

    def _reserve_decode_pages(self) -> None:
        """Every decoding request needs room for one more token; retract the newest until that holds."""
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if req.remaining == 1 and not self.kv.grow(req, 1):
                victim = self.running[-1]
                self._retract(victim)
                if victim is req:
                    continue  # req itself was the newest: it left running; same index is the next request
                continue  # retry req with the freed memory
            i += 1

    def _retract(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.release(req, keep=True)
        req.status = Status.WAITING
        req.retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def _admit(self, seqs: list[ScheduledSeq], budget: int) -> int:
        if not self.waiting or budget <= 0:
            return budget
        waiting = order_waiting(list(self.waiting), self.cfg.schedule_policy,
                                lambda r: len(self.kv.match(r).pages))
        decoding = sum(1 for r in self.running if r.remaining == 1)
        admitted: list[Request] = []
        for req in waiting:
            if budget <= 0 or len(self.running) >= self.cfg.max_running_requests:
                break
            leader = req.group_leader
            if leader is not None and not (leader.prefill_done or leader.finished):
                continue  # n > 1: wait for the leader's prompt to be cached, then share its pages
            match = self.kv.match(req)
            n = self._chunk(req.seq_len - match.num_tokens, budget, first=budget == self.cfg.max_prefill_tokens)
            if n == 0:
                break
            # headroom: one page per decoding request, so admission does not force an immediate retraction
            if not self.kv.admit(req, match, headroom_pages=decoding):
                break
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(req)
            seqs.append(ScheduledSeq(req, req.kv_len, n, n == req.remaining))
            budget -= n
        for req in admitted:
            self.waiting.remove(req)
        return budget

    # -- applying a step's results -----------------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, next_tokens: dict[Request, int]) -> list[Request]:
        """Advance kv_len, append sampled tokens, finish requests on stop tokens or length. Returns the
        requests that got a new token this step (finished ones included)."""
        produced = []
        for seq in batch.seqs:
            req = seq.req
            if req.finished:  # aborted while the step ran
                continue
            req.kv_len = seq.end
            if not seq.sample:
                continue
            token = next_tokens[req]
            req.output_ids.append(token)
            produced.append(req)
            if not req.prefill_done:
                req.prefill_done = True
                self.kv.cache_prefix(req)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason, token if reason == "stop" else None)
        return produced

    def _stop_reason(self, req: Request, token: int) -> str | None:
        if token in req.sampling.stop_token_ids:
            return "stop"
        if not req.sampling.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, detail: object = None, release: bool = True) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_detail = detail
        if release and req.pages:
            self.kv.release(req, keep=reason != "abort")

    # -- introspection -----------------------------------------------------------------------------------------
    def page_owners(self) -> list[list[int]]:
        """Owners of every used page (the prefix cache, then each request's private pages)."""
        owners = [self.kv.cache.owned_pages()]
        owners.extend(r.pages[r.num_cached_pages:] for r in self.running)
        return owners

    def check_integrity(self) -> None:
        self.kv.allocator.check_integrity(self.page_owners())
