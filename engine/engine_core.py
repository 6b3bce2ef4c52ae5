"""The synchronous engine core: model, KV pool, prefix cache, scheduler, runner and sampler wired together.
``step()`` runs one iteration (schedule -> forward -> sample -> update -> detokenize); the async engine calls it
from its own thread, tests call it directly."""
from __future__ import annotations

import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable

import torch

from engine.config import EngineConfig, EngineConfigError
from engine.detokenizer import IncrementalDetokenizer
from engine.grammar.compiler import GrammarCache
from engine.grammar.masks import MaskFiller
from engine.grammar.state import GrammarRejected, GrammarState
from engine.mem.allocator import PageAllocator
from engine.mem.base import NoPrefixCache, PrefixCache
from engine.mem.budget import pool_tokens
from engine.mem.hicache import host_tier_for
from engine.mem.hiradix_cache import HiRadixCache
from engine.mem.kv_pool import KVPool, KVShape
from engine.mem.radix_cache import RadixCache
from engine.mem.storage import weight_files
from engine.models import load_model
from engine.models.loader import DTYPES
from engine.models.source import resolve_model_path
from engine.request import Abort, Request
from engine.role import EngineRole
from engine.runner.attention import create_backend
from engine.runner.model_runner import ModelRunner
from engine.sampler import TokenLogprob, record_prompt_logprobs, sample
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler, StepRecord
from engine.spec import Drafter, Speculator, create_drafter, draft_rows, measure_prior, split_rows
from engine.spec.tree import moves
from engine.step_output import StepOutput, token_output
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
LOAD_POLL_S = 0.002  # how often the engine thread looks for finished load-backs while nothing else can run


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class EngineCore:
    """``kv_buffer`` maps the pool's byte size to memory to build it in (shared memory another process writes into);
    ``role`` makes the worker role whose hooks run around each step, once the pool exists (a transfer manager
    needs its address), as the constructor's last act; ``drafter`` replaces the configured speculative drafter."""

    def __init__(self, cfg: EngineConfig, kv_buffer: Callable[[int], memoryview] | None = None,
                 role: Callable[[EngineCore], EngineRole] | None = None, drafter: Drafter | None = None) -> None:
        self.cfg = cfg
        cfg.cache.check()
        mc = cfg.model
        self.source = resolve_model_path(mc.model_path)
        self.model_dir = self.source.folder  # config.json and tokenizer files (a GGUF's are converted once)
        self.device = resolve_device(mc.device)
        if mc.num_threads > 0 and self.device.type == "cpu":
            torch.set_num_threads(mc.num_threads)
        self.model, self.arch, self.dtype = load_model(self.model_dir, mc.dtype, self.device,
                                                            prepack=mc.weight_prepack, gguf=self.source.gguf,
                                                            huge_pages=mc.huge_pages != "off")
        self.tokenizer = Tokenizer(self.model_dir)
        self.served_model_names: tuple[str, ...] = tuple(mc.served_model_name or (self.source.name,))
        self.served_model_name = self.served_model_names[0]
        page = cfg.cache.page_size
        if page < 1:
            raise EngineConfigError("--page-size must be at least 1")
        kv_dtype = self.dtype if cfg.cache.kv_cache_dtype == "auto" else DTYPES[cfg.cache.kv_cache_dtype]
        probe = KVShape(self.arch.num_layers, 1, 1, self.arch.num_kv_heads, self.arch.head_dim, kv_dtype)
        if drafter is None:
            drafter = create_drafter(cfg.speculative, mc, self.tokenizer, self.arch.vocab_size, self.dtype,
                                     self.device)
        # one memory budget for the target's pool and a draft model's (both hold the same number of tokens)
        tokens = pool_tokens(cfg.cache, probe.bytes_per_token + (drafter.kv_bytes_per_token if drafter else 0),
                             self.device)
        num_pages = max(2, tokens // page + 1)  # +1: the reserved null page
        self.kv_shape = KVShape(self.arch.num_layers, num_pages, page, self.arch.num_kv_heads,
                                self.arch.head_dim, kv_dtype)
        self.pool = KVPool(self.kv_shape, self.device,
                           kv_buffer(self.kv_shape.total_bytes) if kv_buffer is not None else None)
        self.allocator = PageAllocator(num_pages)
        self.hicache = host_tier_for(cfg.cache, self.pool, self.allocator, self.device, self.model_dir / "config.json",
                                     lambda: weight_files(self.source.folder, self.source.gguf), str(self.dtype))
        policy = cfg.cache.radix_eviction_policy
        self.cache: PrefixCache = (
            NoPrefixCache(page) if cfg.cache.disable_radix_cache else
            RadixCache(page, self.allocator.free, policy) if self.hicache is None else
            HiRadixCache(page, self.allocator.free, policy, self.hicache))
        self.context_length = min(mc.context_length or self.arch.max_position_embeddings,
                                  self.allocator.capacity * page)
        eos = tuple(dict.fromkeys(self.arch.eos_token_ids + self.tokenizer.eos_token_ids))
        self.scheduler = Scheduler(cfg.scheduler, self.allocator, self.cache, page, eos)
        backend = create_backend(mc.attention_backend, self.pool, self.arch.num_heads, self.arch.head_dim)
        self.runner = ModelRunner(self.model, self.pool, backend, self.device,
                                  hidden=drafter is not None and drafter.wants_hidden_states,
                                  layer_stack=mc.decode_stack != "off")
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        self.requests: dict[str, Request] = {}
        self.step_records: deque[StepRecord] = deque(maxlen=4096)  # drained by metrics on the event loop
        self.grammars = (GrammarCache(self.tokenizer.hf, self.arch.vocab_size, eos, cfg.grammar.grammar_cache_size)
                         if cfg.grammar.grammar_backend == "xgrammar" else None)
        self.masks = MaskFiller(self.arch.vocab_size)
        self.spec: Speculator | None = None
        if drafter is not None:
            drafter.allocate((num_pages - 1) * page, page)
            k = cfg.speculative.speculative_num_draft_tokens
            prior = measure_prior(self.runner.forward, self.allocator, page, k, drafter.time_forward(),
                                  drafter.time_catch_up())
            self.spec = Speculator(cfg.speculative, drafter, self.arch.vocab_size, prior)
        self._special_ids = frozenset(self.tokenizer.hf.all_special_ids)
        self.role = role(self) if role is not None else EngineRole()
        log.info("engine ready: model=%s arch=%s dtype=%s kv_dtype=%s device=%s kv_pages=%d page_size=%d "
                 "context=%d", self.source.path, self.arch.architecture, self.dtype, kv_dtype, self.device,
                 num_pages - 1, page, self.context_length)

    # -- requests ----------------------------------------------------------------------------------------------
    def make_request(self, prompt_ids: list[int], sampling: SamplingParams, rid: str | None = None,
                     extra_key: str | None = None, priority: int = 0, detokenize: bool = True,
                     choice: int = 0, group_leader: Request | None = None, grammar: object = None) -> Request:
        """Validate and build a request (raises InvalidRequestError with a client-facing message). ``grammar``:
        the compiled form of ``sampling.grammar`` (``self.grammars`` compiles it), required when that is set."""
        sampling.validate(self.arch.vocab_size)
        if (sampling.grammar is None) != (grammar is None):
            raise ValueError("a request's grammar must be compiled before the request is made")
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context length is {self.context_length} "
                f"(prompt + output), so shorten the prompt", param="prompt", code="context_length_exceeded")
        # after the length check: a prompt far over the context is refused without a scan of its ids
        bad = next((t for t in prompt_ids if not 0 <= t < self.arch.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {self.arch.vocab_size})",
                                      param="input_ids")
        max_new = sampling.max_new_tokens if sampling.max_new_tokens is not None else room
        if max_new > room:
            raise InvalidRequestError(
                f"max_tokens={max_new} plus the prompt's {len(prompt_ids)} tokens exceeds the context length "
                f"{self.context_length}; ask for at most {room}", param="max_tokens",
                code="context_length_exceeded")
        seed = None if sampling.seed is None else (sampling.seed + choice * 0x9E3779B97F4A7C15) & ((1 << 63) - 1)
        req = Request(rid=rid or uuid.uuid4().hex, prompt_ids=list(prompt_ids), sampling=sampling,
                      max_new_tokens=max_new, extra_key=extra_key, priority=priority, seed=seed,
                      group_leader=group_leader)
        if detokenize:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, sampling.skip_special_tokens,
                                               sampling.stop)
        if grammar is not None:
            stops = tuple(dict.fromkeys((*self.scheduler.eos_token_ids, *sampling.stop_token_ids)))
            req.grammar = GrammarState(grammar, stops)
        return req

    def add_request(self, req: Request) -> None:
        if req.rid in self.requests:
            raise InvalidRequestError(f"request id {req.rid!r} is already in flight", param="rid")
        self.role.add(self, req)
        self.requests[req.rid] = req

    def abort(self, rid: str, reason: Abort) -> StepOutput | None:
        req = self.scheduler.abort(rid, reason)
        if req is None:
            return None
        self.requests.pop(rid, None)
        if self.spec is not None:
            self.spec.release(req)
        self.role.on_abort(self, req)
        return StepOutput(req, finished=True)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.scheduler.has_pending

    def idle_wait(self) -> float | None:
        """How long the engine thread may wait for new commands: 0 with work to compute (LOAD_POLL_S when all of
        it waits for prefixes loading from a lower cache tier), the role's poll interval while only transfers
        are pending, None (indefinitely) when idle."""
        if self.scheduler.has_work:
            return LOAD_POLL_S if self.scheduler.idle_on_loads else 0.0
        return self.role.poll_interval_s if self.scheduler.has_pending else None

    def idle_chore(self) -> bool:
        """Background work for an idle engine, one bounded piece per call (faulting the KV pool in: KVPool.
        prefault_next, ~4 ms); False when none is left."""
        if not self.pool.prefault_pending:
            return False
        self.pool.prefault_next()
        return True

    # -- one iteration -----------------------------------------------------------------------------------------
    def step(self, emit: Callable[[list[StepOutput]], None] | None = None) -> list[StepOutput]:
        """``emit``, when given, gets the role's outputs from before the forward pass at once (a decode worker's
        first tokens, when their rooms succeed), so they do not wait for this step's batch."""
        outputs = self.role.before_step(self)
        if emit is not None and outputs:
            self._forget_finished(outputs)
            emit(outputs)
            outputs = []
        batch = self.scheduler.schedule()
        if batch is not None:
            if self.spec is not None:
                batch = self.spec.draft(batch, self.scheduler)
            start = time.perf_counter()
            outputs += self._run_batch(batch)
            seconds = time.perf_counter() - start
            self.scheduler.observe_step(seconds)
            self.step_records.append(batch.record(seconds))
            if self.spec is not None:
                self.spec.observe(batch, seconds)
        outputs += self.role.after_step(self, batch)
        self._forget_finished(outputs)
        return outputs

    def _forget_finished(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.requests.pop(out.req.rid, None)
                if self.spec is not None:
                    self.spec.release(out.req)

    def _run_batch(self, batch: ScheduledBatch) -> list[StepOutput]:
        """Forward, sample, verify drafts, update, detokenize. A forward failure fails the step (the caller aborts
        what ran); a failure that belongs to one request (its sampling, its detokenization or stop strings) fails
        that request alone with a 500 naming the stage, and the rest of the batch goes on."""
        order = self.runner.sampled_order(batch)
        rows = [row for s in order for row in (draft_rows(s.req, s.draft, s.parents) if s.draft else (s.req,))]
        fill = self.masks.start([r.grammar for r in rows], [getattr(r, "ahead", ()) for r in rows])
        fwd = self.runner.forward(batch)  # the masks fill meanwhile
        logits, prompt_logits = fwd.logits, fwd.prompt_logits
        errors: dict[int, Exception] = {}
        outputs: list[StepOutput] = []
        mask = fill.result() if fill is not None else None
        if mask is not None:
            errors.update(mask.errors)
        with torch.inference_mode():  # the logits are inference tensors: penalties update them in place
            for seq, prompt_rows in prompt_logits:
                try:
                    record_prompt_logprobs(seq.req, seq.start, prompt_rows)
                except Exception as e:  # noqa: BLE001 - this request's logprobs, not the batch's
                    outputs.append(self.fail_request(seq.req, "prompt logprobs", e))  # update() then skips it
            tokens, logprobs = (sample(logits, rows, self.generator, errors, mask.apply if mask else None)
                                if rows else ([], []))
        verified = split_rows(order, tokens, logprobs, errors, self.spec)
        new, lps, drafts, failed = verified[:4]
        if fwd.hidden is not None and fwd.first_rows is not None and self.spec is not None:
            self.spec.observe_hidden(batch.seqs, fwd.hidden, fwd.first_rows, verified)
        for seq in order:  # an accepted tree path's K/V goes where a chain's would be, before anything reads it
            if seq.parents and seq.req in verified.nodes and (shift := moves(verified.nodes[seq.req])):
                self.runner.settle_draft(seq, shift)
        for req in [r for r in new if r.grammar is not None and not r.finished]:
            try:  # a grammar that completes inside a verified run ends the run there
                new[req] = new[req][:req.grammar.accept_run(new[req])]
            except GrammarRejected as e:
                failed.append((req, e))
                del new[req]
        outputs += [self.fail_request(req, "sampling", e) for req, e in failed if not req.finished]
        produced = self.scheduler.update(batch, new)  # n <= len(new[req]): a stop token may end a run early
        for req, n in produced.items():
            try:
                jumped = self._follow_grammar(req) if req.grammar is not None else 0
                out = token_output(self.scheduler, req, lps[req][:n], jumped, new=n)
                if req in drafts:  # drafts kept among the tokens emitted (a stop may have cut the run)
                    out.drafted, out.accepted = drafts[req][0], min(drafts[req][1], len(out.new_token_ids) - jumped - 1)
                outputs.append(out)
            except Exception as e:  # noqa: BLE001 - this request's text, not the batch's
                outputs.append(self.fail_request(req, "detokenization", e))
        return outputs

    def _follow_grammar(self, req: Request) -> int:
        """After a token the grammar accepted: end the request if the grammar is complete, else append what it
        forces (jump-forward); returns how many tokens were forced."""
        if req.finished:
            return 0
        if req.grammar.terminated:
            self.scheduler.finish(req, "stop")
            return 0
        sp = req.sampling
        if not self.cfg.grammar.jump_forward or sp.logprobs is not None or sp.logit_bias or sp.stop:
            return 0  # jumped tokens get no logprobs, no bias, and may run past a stop string
        limit = req.max_new_tokens - len(req.output_ids) - 1  # leave the last token to the model (length)
        tokens = req.grammar.jump_forward(lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                                          self.tokenizer.token_text, req.output_ids[-1],
                                          self._special_ids | frozenset(sp.stop_token_ids), limit)
        if tokens and not self.scheduler.append_forced(req, tokens):
            req.grammar.rollback(len(tokens))
            return 0
        return len(tokens)

    def fail_request(self, req: Request, stage: str, error: Exception) -> StepOutput:
        """End one request with a 500 that names the stage that failed; its pages are released as on abort."""
        log.error("request %s failed in %s: %s: %s", req.rid, stage, type(error).__name__, error,
                  exc_info=error)
        reason = Abort(500, f"this request failed in {stage}: {type(error).__name__}: {error}", "request_failed")
        out = self.abort(req.rid, reason)
        if out is None:  # it had already finished this step: report the failure instead of its end
            req.finish_reason, req.finish_detail = "abort", reason
            out = StepOutput(req, finished=True)
        return out

    def run_to_completion(self, reqs: list[Request], max_steps: int = 100_000) -> None:
        """Add ``reqs`` and step until all finish (for tests and offline use)."""
        for r in reqs:
            self.add_request(r)
        for _ in range(max_steps):
            if all(r.finished for r in reqs):
                return
            self.step()
            if self.scheduler.idle_on_loads:
                time.sleep(LOAD_POLL_S)
        raise RuntimeError(f"requests did not finish within {max_steps} steps")

    # -- what a worker role may do with its requests (engine/role.py) ----------------------------------------------
    def queue(self, req: Request) -> None:
        """Compute the request here, prompt and output."""
        self.scheduler.add(req)

    def queue_held(self, req: Request) -> None:
        """Compute its prompt and first token only, and keep its pages after it finishes, until release_held:
        another process reads them."""
        req.max_new_tokens, req.hold_kv = 1, True
        self.scheduler.add(req)

    def queue_external(self, req: Request) -> None:
        """Its prompt's KV will be written from outside: it waits for pages (reserve_external), then activate."""
        self.scheduler.add_for_transfer(req)

    def reserve_external(self, reserve_tokens: int, limit: int) -> list[Request]:
        """Pages for queued external requests, in arrival order, at most ``limit`` reserved at once, keeping
        ``reserve_tokens`` of output headroom per request; the pages stay the request's until activate or
        release_held. Each one's ``kv_len`` is the prefix this engine's cache already held."""
        reqs = self.scheduler.reserve_for_transfer(reserve_tokens, limit)
        for req in reqs:
            req.hold_kv = True
        return reqs

    def activate(self, req: Request, first_token: int, lp: TokenLogprob | None = None, *,
                 cached_tokens: int | None = None, prompt_logprobs: list | None = None) -> StepOutput:
        """The external KV arrived with the first output token: the request joins the batch (``cached_tokens``:
        what the writer found cached; ``prompt_logprobs``: what it computed)."""
        req.hold_kv = False
        req.cached_tokens = cached_tokens
        if prompt_logprobs is not None:
            req.prompt_logprobs = prompt_logprobs
        self.scheduler.activate(req, first_token)
        jumped = 0
        if req.grammar is not None:
            try:
                req.grammar.accept(first_token)
                jumped = self._follow_grammar(req)
            except Exception as e:  # noqa: BLE001 - this request's grammar (or its peer's token), not the step's
                return self.fail_request(req, "sampling", e)
        return token_output(self.scheduler, req, [lp] if lp is not None else None, jumped)

    def end(self, req: Request, reason: Abort) -> StepOutput:
        """End the request with an error (its pages stay held if they are); the output that says so."""
        self.scheduler.abort(req.rid, reason)
        return StepOutput(req, finished=True)

    def holds(self, req: Request) -> bool:
        """The request finished but its pages are kept for an outside reader or writer."""
        return req in self.scheduler.held

    def release_held(self, req: Request, keep: bool = True) -> None:
        """Nothing outside uses the pages any more: give them back (``keep``: whole computed pages go to the
        prefix cache). A request not held is left alone."""
        if req in self.scheduler.held:
            self.scheduler.release_held(req, keep=keep)

    # -- cache control and introspection -------------------------------------------------------------------------
    def close(self) -> None:
        """Release what outlives a step: the role's transfer resources, the shared store's connection."""
        self.role.close()
        if self.hicache is not None:
            self.hicache.close()

    def flush_cache(self) -> int:
        return self.cache.flush()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        if isinstance(self.cache, RadixCache):
            self.cache.check_invariants()  # and the host tier's pages, with HiCache
        if self.spec is not None:
            self.spec.drafter.check_integrity()
