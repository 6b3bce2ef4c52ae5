"""Draft-model speculation: a smaller model with the target's vocabulary proposes k tokens per request, one greedy
token per draft forward, each forward batched over the step's drafting requests. It runs on its own ModelRunner
over its own paged KV pool (as many tokens as the target's pool; engine_core splits the memory budget between the
two by their bytes per token), so it never touches the target's pages.

Per request the drafter keeps a shadow sequence: the tokens it fed the draft model (their KV computed up to
``kv_len``) and the drafts it proposed after them. Before each proposal the shadow is cut back to what the target
kept (accepted drafts keep their draft KV; rejected ones are overwritten later) and the tokens the target emitted
since are fed in one extend, together with the first draft round. The draft model prefills a request's prompt
itself the first time it drafts (in PD that happens on the decode worker: the prefill worker knows nothing of the
draft; see docs/api.md for why and what it costs), at most ``PREFILL_BUDGET`` tokens per step across requests, so
a long prompt does not lengthen other requests' steps; a request still catching up gets no draft that step.

Drafts are the draft model's argmax whatever the request's sampling: verification re-samples each position from
the target (engine/spec/verify.py), so the output keeps the target's distribution with any drafter; a sampled
request accepts a draft token with the target's probability of it."""
from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from engine.config import EngineConfigError, ModelConfig, SpeculativeConfig
from engine.mem.allocator import AllocatorIntegrityError, PageAllocator
from engine.mem.kv_pool import KVPool, KVShape
from engine.models import load_model
from engine.models.config import ArchConfig
from engine.models.source import resolve_model_path
from engine.request import Request
from engine.runner.attention import create_backend
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler.batch import ScheduledBatch, ScheduledSeq
from engine.scheduler.kv_manager import pages_for
from engine.spec.base import Drafter
from engine.spec.prior import BATCHES, time_extend, time_shapes
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PREFILL_BUDGET = 512  # draft-model prompt tokens computed per step, across requests
CATCH_UP_PROBE = 256  # prompt tokens of the extend timed at load for the catch-up's cost per token
_PLAIN = SamplingParams()


@dataclass(eq=False)
class _Shadow:
    seq: Request  # the draft model's view: prompt_ids are the fed tokens plus the pending drafts; pages are its own
    seen: int  # the target's sequence length at the last sync


class DraftModelDrafter(Drafter):
    name = "draft_model"

    def __init__(self, model: torch.nn.Module, arch: ArchConfig, kv_dtype: torch.dtype, device: torch.device,
                 attention_backend: str, vocab_size: int, layer_stack: bool = True) -> None:
        self.model, self.arch, self.device = model, arch, device
        self.layer_stack = layer_stack
        self.kv_dtype = kv_dtype
        self.attention_backend = attention_backend
        self.vocab_size = min(vocab_size, arch.vocab_size)  # drafts stay inside the target's vocabulary
        self.kv_bytes_per_token = KVShape(arch.num_layers, 1, 1, arch.num_kv_heads, arch.head_dim,
                                          kv_dtype).bytes_per_token
        self._shadows: weakref.WeakKeyDictionary[Request, _Shadow] = weakref.WeakKeyDictionary()
        # pages of shadows whose request was dropped without release (a finalizer may run on any thread, so
        # it only queues them; propose frees them on the engine thread)
        self._orphans: deque[list[int]] = deque()
        self.draft_seconds: float | None = None
        self.allocator: PageAllocator | None = None
        self.runner: ModelRunner | None = None
        self.page_size = 0

    def allocate(self, num_tokens: int, page_size: int) -> None:
        num_pages = max(2, num_tokens // page_size + 1)  # +1: the null page
        shape = KVShape(self.arch.num_layers, num_pages, page_size, self.arch.num_kv_heads, self.arch.head_dim,
                        self.kv_dtype)
        pool = KVPool(shape, self.device)
        backend = create_backend(self.attention_backend, pool, self.arch.num_heads, self.arch.head_dim)
        self.runner = ModelRunner(self.model, pool, backend, self.device, layer_stack=self.layer_stack)
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        log.info("draft model ready: arch=%s layers=%d kv_pages=%d", self.arch.architecture, self.arch.num_layers,
                 num_pages - 1)

    # -- shadows -------------------------------------------------------------------------------------------------
    def _sync(self, req: Request) -> _Shadow:
        """The request's shadow, cut back to the longest prefix the target kept and extended by what it emitted."""
        length = req.seq_len
        sh = self._shadows.get(req)
        if sh is None:
            sh = self._shadows[req] = _Shadow(Request(req.rid, req.tokens(0, length), _PLAIN, 0), length)
            weakref.finalize(req, self._orphans.append, sh.seq.pages)  # release() empties that same list
            return sh
        ids = sh.seq.prompt_ids
        new = req.tokens(sh.seen, length)
        same = 0
        for mine, theirs in zip(ids[sh.seen:], new):
            if mine != theirs:
                break
            same += 1
        common = sh.seen + same
        del ids[common:]
        ids.extend(new[same:])
        # the newest token is always fed again: its logits give the first draft (its KV may be there already,
        # from a draft the target emitted without verifying it)
        sh.seq.kv_len = min(sh.seq.kv_len, common, length - 1)
        sh.seen = length
        return sh

    def _grow(self, sh: _Shadow, tokens: int, keep: set[int]) -> bool:
        """Pages for the shadow's first ``tokens`` positions; short of free pages, shadows of requests outside
        ``keep`` (ids of this proposal's requests) give theirs back first."""
        assert self.allocator is not None
        need = pages_for(tokens, self.page_size) - len(sh.seq.pages)
        if need > self.allocator.available:
            idle = [(req, other) for req, other in self._shadows.items() if id(other) not in keep and other.seq.pages]
            if need > self.allocator.available + sum(len(other.seq.pages) for _, other in idle):
                return False  # not even all of them would do: keep their KV
            for req, _ in idle:
                self.release(req)
                if need <= self.allocator.available:
                    break
        sh.seq.pages.extend(self.allocator.alloc(need) or [])
        return True

    # -- proposing -------------------------------------------------------------------------------------------------
    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        assert self.runner is not None and self.allocator is not None, "allocate() comes first"
        while self._orphans:
            self.allocator.free(self._orphans.popleft())
        out: list[list[int]] = [[] for _ in reqs]
        shadows = [self._sync(r) if k > 0 else None for r, k in zip(reqs, limits)]
        keep = {id(sh) for sh in shadows if sh is not None}
        budget = PREFILL_BUDGET
        catch_up: list[ScheduledSeq] = []  # prompt (or long-skipped) tokens: KV only
        first: list[ScheduledSeq] = []  # the newest tokens, sampled for the first draft
        drafting: list[tuple[int, _Shadow, int]] = []  # (index, shadow, draft length)
        for i, (sh, k) in enumerate(zip(shadows, limits)):
            if sh is None:
                continue
            seq = sh.seq
            length = len(seq.prompt_ids)
            todo = length - seq.kv_len
            if length + k > self.arch.max_position_embeddings:
                continue
            if todo > max(budget, k + 1):  # catch up by a chunk this step, draft on a later one (the few
                # tokens a verification emits never wait for the budget)
                if budget > 0 and self._grow(sh, seq.kv_len + budget, keep):
                    catch_up.append(ScheduledSeq(seq, seq.kv_len, budget, sample=False))
                    budget = 0
                continue
            if not self._grow(sh, length + k - 1, keep):
                continue
            budget -= todo
            last = min(todo, k + 1)  # what a verification emits is drafting work; more is catching up
            if todo > last:
                catch_up.append(ScheduledSeq(seq, seq.kv_len, todo - last, sample=False))
            first.append(ScheduledSeq(seq, length - last, last, sample=True))
            drafting.append((i, sh, k))
        if catch_up:
            self._round(catch_up)
        start = time.perf_counter()  # the drafting proper (the speculator weighs it against what drafts save)
        if first:
            self._round(first)
        for r in range(1, max((k for _, _, k in drafting), default=0)):
            self._round([ScheduledSeq(sh.seq, sh.seq.kv_len, 1, sample=True) for _, sh, k in drafting if k > r])
        self.draft_seconds = time.perf_counter() - start
        for i, sh, k in drafting:
            out[i] = sh.seq.prompt_ids[sh.seen:sh.seen + k]
        return out

    def _round(self, seqs: list[ScheduledSeq]) -> None:
        """One draft forward: each sequence's tokens get KV; a sampled one appends its argmax to its shadow."""
        assert self.runner is not None
        result = self.runner.forward(ScheduledBatch(seqs))
        best = result.logits[:, :self.vocab_size].argmax(dim=-1).tolist()
        for s in seqs:
            s.req.kv_len = s.end
        for s, token in zip(result.sampled, best):
            s.req.prompt_ids.append(token)

    def time_forward(self) -> dict[int, float]:
        assert self.runner is not None and self.allocator is not None, "allocate() comes first"
        return time_shapes(self.runner.forward, self.allocator, self.page_size, [(b, 1) for b in BATCHES])

    def time_catch_up(self) -> float:
        assert self.runner is not None and self.allocator is not None, "allocate() comes first"
        return time_extend(self.runner.forward, self.allocator, self.page_size, CATCH_UP_PROBE) / CATCH_UP_PROBE

    def pending_tokens(self, req: Request) -> int:
        sh = self._shadows.get(req)
        return max(0, req.seq_len - (0 if sh is None else sh.seq.kv_len))

    def release(self, req: Request) -> None:
        sh = self._shadows.pop(req, None)
        if sh is not None and self.allocator is not None:
            self.allocator.free(sh.seq.pages)
            sh.seq.pages.clear()

    def check_integrity(self) -> None:
        if self.allocator is not None:
            try:
                self.allocator.check_integrity([sh.seq.pages for sh in self._shadows.values()])
            except AllocatorIntegrityError as e:
                raise AllocatorIntegrityError(f"draft model's pool: {e}") from e


def load_draft_model(cfg: SpeculativeConfig, target: ModelConfig, tokenizer: Tokenizer, vocab_size: int,
                     target_dtype: torch.dtype, device: torch.device) -> DraftModelDrafter:
    """Load the draft model; refuse one whose vocabulary differs from the target's (its drafts would be other
    tokens' ids)."""
    assert cfg.speculative_draft_model_path is not None
    path = cfg.speculative_draft_model_path
    source = resolve_model_path(path)
    draft_tokenizer = Tokenizer(source.folder)
    if draft_tokenizer.hf.get_vocab() != tokenizer.hf.get_vocab():
        raise EngineConfigError(f"--speculative-draft-model-path {path}: its tokenizer's vocabulary differs from the "
                                "target model's; a draft model must share the target's tokenizer")
    dtype = str(target_dtype).replace("torch.", "") if cfg.speculative_draft_dtype == "auto" else \
        cfg.speculative_draft_dtype
    model, arch, torch_dtype = load_model(source.folder, dtype, device, prepack=target.weight_prepack,
                                          gguf=source.gguf, huge_pages=target.huge_pages != "off")
    if arch.vocab_size < vocab_size:
        raise EngineConfigError(f"--speculative-draft-model-path {path}: its embedding has {arch.vocab_size} rows, "
                                f"fewer than the target's {vocab_size} token ids; the draft could not read every "
                                "token the target may see")
    return DraftModelDrafter(model, arch, torch_dtype, device, target.attention_backend, vocab_size,
                             layer_stack=target.decode_stack != "off")
