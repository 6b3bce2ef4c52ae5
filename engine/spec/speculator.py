"""Speculative decoding around the engine's step: ``draft`` gives the step's decoding requests draft tokens (and their
pages), ``verify`` turns each request's sampled rows into the tokens it emits (engine/spec/verify.py).

Who speculates (measured on SmolLM2, see docs/benchmarks.md): a request whose drafts keep being rejected pays for
the extra rows of every verification and gains nothing, so each request tracks its acceptance rate per draft
position (an exponential average of accepted / positions tried, where the first rejected one was the last tried: the
chance that a draft token is accepted given the ones before it were, which is what ``cost.expected_accepted``
assumes; 1 of 8 accepted is 0.5, not 0.125), starting from the average over all requests so far, so on a workload
that rarely accepts a new request does not start out optimistic). Below ``MIN_ACCEPT`` it stops drafting for a
while, twice as long after each failed probe, and drafts again to probe (meanwhile a drafter that costs nothing to
ask still proposes, and a draft of a kind of evidence that is usually accepted goes on: ``STRONG_EVIDENCE``). A
draft's value is priced from two more averages (``_rates``): the chance its first token is accepted, and the chance
a later one is given the ones before it were. Copied text behaves so: a draft misses at its first token or runs on
(SmolLM2 repeating a paragraph: the first token of about half the drafts accepted, 85-95% of later ones), and one
rate for every position valued an 8th token at 0.5^8 and cut drafts to 2-3 tokens. A drafter may tag a draft with
its evidence (``DraftTree.evidence``; prompt lookup: the length of the suffix it matched), and a first token is then
priced by what drafts of that evidence did over all requests, scaled by how this request's first tokens fare against
all requests' (SmolLM2's copy tasks learn ~0.4-0.5 after a 1-token match, 0.8-0.9 after 3 or 4). The drafts proposed
for a step are cut to the lengths that maximise the step's expected tokens per second (engine/spec/cost.py: step
time by rows, learnt from this engine's own decode steps), so a batch large enough to make rows costly drafts less
or not at all. A constrained request's drafts are cut at the first token its grammar refuses, so every verified
position is one the grammar allows (and its mask is filled as if the drafts before it were accepted). Requests whose
pages a transfer still holds never draft. A drafter that costs time of its own (a draft model) drafts only while the
expected tokens per second with its drafts, its own time counted (learnt like the step's, by drafted tokens), beat
plain decoding, with the drafter's first reading of a request (a draft model prefilling its prompt) spread over the
request's remaining output (``_catch_up``); the probe steps draft regardless, so the estimate follows the requests'
acceptance, and while the gate stays shut each probe comes twice as late as the last (64 steps up to 2048), and
drafts for one request only, so a draft model that does not pay costs little more than its memory.

The cost models do not start empty: at load the engine times plain and verified steps, and a draft model's
forward, over scratch pages (engine/spec/prior.py), so the first requests are decided on this host's costs. A
drafter that could not pay even with every draft accepted (a draft model as slow as its target; with ``MARGIN``
to spare) does not draft at all. ``--speculative-policy acceptance`` drafts wherever acceptance allows,
whatever the costs say (to measure a drafter where it cannot pay)."""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from engine.spec.base import Drafter
from engine.spec.cost import StepCost, expected_accepted
from engine.spec.prior import CostPrior
from engine.spec.tree import DraftTree, depths, path, walk
from engine.spec.verify import Verified, feature_rows

log = logging.getLogger(__name__)

MIN_ACCEPT = 0.3  # acceptance ratio below which a request pauses drafting
EMA = 0.3  # weight of the newest verification in a request's acceptance average
GLOBAL_EMA = 0.05  # the same over every request's verifications: a new request's prior
FIRST_FLOOR = 0.05  # the least all requests' first-token acceptance a class's is scaled against
CHEAP = 0.05  # a drafter whose time is below this share of a step's is left to the per-draft choice
# a costly drafter must be expected to beat plain decoding by this much: its catch-up prefill and the wider
# sampling of a verification are not in the costs (SmolLM2 float32 drafted by itself in bfloat16, batch 1,
# predicted 1.05x with every draft accepted, measured 0.93x at 98% accepted)
MARGIN = 0.10
# steps a request pauses after its acceptance fell below MIN_ACCEPT, doubling per failed probe. Short, since
# copying comes in bursts and a probe after a pause is cut to a draft or two (cost.trim): SmolLM2 float32 batch 1,
# one interleaved run, ngram against off, a cap of 256 -> 8: copy 1.59x -> 1.65x, random prompts 1.12x -> 1.33x.
BACKOFF_MIN, BACKOFF_MAX = 4, 8
# a pausing request still drafts, with a drafter that costs nothing to ask (prompt lookup), where the draft's kind
# of evidence has its first token accepted at least this often over all requests: copying resumes after a stretch
# of new text, and a lookup that matched the last 2-4 tokens is the first sign of it. SmolLM2 bfloat16, batch 1,
# bench_spec's copy tasks: pausing steps whose lookup matched 2-4 tokens would have had 76% of their drafts' first
# tokens accepted (1 token: 41%). Drafting there, against pausing regardless (interleaved, 6 repeats, ngram / off):
# 1.73x -> 1.85x, 243 -> 239 forwards for 508 tokens; random prompts at batch 16 level (0.93x / 0.99x, 4 repeats)
STRONG_EVIDENCE = 0.5
# verifications of a class before it counts as strong: a class's average starts from all requests' first-token
# rate (1.0 at start) and moves by GLOBAL_EMA a verification, so a class seen a few times says little (random
# prompts at batch 16: the 1-token class still read 0.81-0.86 after 3 verifications, none accepted)
STRONG_SEEN = 16
PROBE_EVERY = 64  # drafting steps: in one of this many every drafted request verifies at least one draft token
PROBE_MAX = 2048  # the longest probe interval, reached while a costly drafter keeps not paying


@dataclass
class _Track:
    ema: float  # a new request starts from the speculator's acceptance over all requests
    first: float  # the chance its first draft token is accepted (an average, as ``ema``)
    deep: float  # the chance a later draft token is accepted given the ones before it were
    evidence: int = 0  # the evidence of its latest draft (DraftTree.evidence)
    pause: int = 0  # steps left without drafting
    backoff: int = BACKOFF_MIN


def _by_value(tree: DraftTree, rate: float, first: float | None = None) -> tuple[DraftTree, list[float]]:
    """The tree's nodes ordered by their expected acceptance, first * rate^(depth - 1) (``first`` defaults to
    ``rate``) times the drafter's weight (no more than the parent's), highest first and parents before children,
    and those values: cost.trim keeps a prefix."""
    level = depths(tree.parents, len(tree))
    lead = rate if first is None else first
    values: list[float] = []
    for i, p in enumerate(tree.parents):
        values.append(min(tree.weights[i] * lead * rate ** (level[i] - 1), values[p] if p >= 0 else 1.0))
    order = sorted(range(len(tree)), key=lambda i: -values[i])  # stable: a tie keeps the parent first
    return tree.keep(order), [values[i] for i in order]


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, drafter: Drafter, vocab_size: int,
                 prior: CostPrior | None = None) -> None:
        self.cfg = cfg
        self.drafter = drafter
        self.vocab_size = vocab_size
        self._tracks: weakref.WeakKeyDictionary[Request, _Track] = weakref.WeakKeyDictionary()
        cfg.check()
        self._adaptive = cfg.speculative_policy == "adaptive"  # "acceptance": costs are measured, never obeyed
        self.cost = StepCost(prior.target if prior else None)
        # the drafter's own seconds, by tokens proposed
        self.draft_cost = StepCost({b * prior.k: prior.k * t for b, t in prior.draft.items()} if prior else None)
        self._steps = 0
        self._probe_every = PROBE_EVERY
        self._next_probe = PROBE_EVERY
        self.catch_up = prior.catch_up if prior else 0.0  # the drafter's seconds per token it has not read
        self.best_gain: float | None = None  # the prior's most speculation could gain at batch 1 (None: no prior)
        self.hopeless = False  # the prior says the drafter cannot pay here: it never drafts
        if prior is not None:
            self._seed(prior)
        self.acceptance = 1.0  # optimistic at start: the first requests draft
        # the same split as _Track's, over all requests: at start every first token is taken for accepted (the
        # first requests draft), a later one for a coin flip until one is seen (a drafter that never hits, and
        # so never shows its later tokens, is not priced at four tokens a draft)
        self.first, self.deep = 1.0, 0.5
        self.first_by_evidence: dict[int, float] = {}  # ``first`` over all requests, per class of draft
        self.seen_by_evidence: dict[int, int] = {}  # verifications that class was learnt from
        self.drafted = 0  # draft tokens verified, and kept, since start
        self.accepted = 0
        self.verifications = 0  # drafted requests verified (one per request per step)

    def _seed(self, prior: CostPrior) -> None:
        """Log the load-time timings; a drafter that could not pay even with every draft accepted is turned off
        (its probes, each catching a request's prompt up in the draft, cost SmolLM2 at batch 16 up to 14% of its
        decode tokens/s while drafting nothing)."""
        self.best_gain = prior.best_gain()
        log.info("speculation: drafter=%s, target step ms by rows %s, draft forward ms by requests %s, catch-up ms "
                 "a token %.3f, best gain %s", self.drafter.name,
                 {r: round(1e3 * t, 2) for r, t in prior.target.items()},
                 {b: round(1e3 * t, 2) for b, t in prior.draft.items()}, 1e3 * prior.catch_up,
                 None if self.best_gain is None else round(self.best_gain, 2))
        if self.best_gain is not None and self.best_gain < 1 + MARGIN and self._adaptive and prior.draft:
            self.hopeless = True
            log.warning("speculation: drafter %s cannot pay here: with all %d drafts accepted a batch-1 step would "
                        "give %.2fx the tokens/s of plain decoding, short of the %.2fx it needs (draft forward "
                        "%.1f ms, target step %.1f ms); it will not draft (--speculative-policy acceptance "
                        "drafts regardless)",
                        self.drafter.name, prior.k, self.best_gain, 1 + MARGIN, 1e3 * prior.draft.get(1, 0.0),
                        1e3 * prior.target[1])

    def _track(self, req: Request) -> _Track:
        t = self._tracks.get(req)
        if t is None:
            t = self._tracks[req] = _Track(self.acceptance, self.first, self.deep)
        return t

    def _rates(self, req: Request, evidence: int = 0) -> tuple[float, float]:
        """(first, deep) of ``req``: the chance its first draft token is accepted, and a later one's given the
        ones before it were. For a draft of a class seen before (``evidence``), its first token's chance is that
        class's, scaled by how the request's own first tokens fare against all requests'."""
        t = self._track(req)
        by = self.first_by_evidence.get(evidence) if evidence else None
        if by is None:
            return t.first, t.deep
        return min(1.0, by * t.first / max(self.first, FIRST_FLOOR)), t.deep

    def _limit(self, seq: ScheduledSeq, pausing_drafts: bool) -> tuple[int, bool]:
        """How deep ``seq`` may draft this step, and whether it is pausing (then it drafts only where
        ``pausing_drafts``: the drafter is cheap and some evidence class strong; and only a draft of a strong class
        goes on: ``draft``)."""
        req = seq.req
        if (seq.num_tokens != 1 or not seq.sample or not req.output_ids or req.hold_kv
                or seq.start != req.seq_len - 1):
            return 0, False
        track = self._track(req)
        k = max(0, min(self.cfg.speculative_num_draft_tokens, req.max_new_tokens - len(req.output_ids) - 1))
        if track.pause > 0:
            track.pause -= 1
            return (k, True) if pausing_drafts else (0, False)
        return k, False

    def _cheap(self) -> bool:
        """Whether proposing a draft costs the drafter a negligible share of a step (prompt lookup; not a draft
        model), or its cost is not known yet."""
        k = self.cfg.speculative_num_draft_tokens
        own, base = self.draft_cost.estimate(k), self.cost.estimate(1)
        return own is None or base is None or own < CHEAP * base

    def draft(self, batch: ScheduledBatch, scheduler: Scheduler) -> ScheduledBatch:
        """The batch with draft tokens on the decoding requests that get some (pages grown for them)."""
        if self.hopeless:
            return batch
        seqs = [s for s in batch.seqs if s.num_tokens == 1]
        strong = {e for e, rate in self.first_by_evidence.items()
                  if rate >= STRONG_EVIDENCE and self.seen_by_evidence.get(e, 0) >= STRONG_SEEN}
        pausing_drafts = bool(strong) and self._cheap()
        limits = [self._limit(s, pausing_drafts) for s in seqs]
        chosen = [(s, k) for s, (k, _) in zip(seqs, limits) if k > 0]
        pausing = {s.req for s, (k, paused) in zip(seqs, limits) if k > 0 and paused}
        if not chosen:
            return batch
        self._steps += 1
        pays = self._pays(len(seqs), chosen)
        probe = self._steps >= self._next_probe
        if pays:
            self._probe_every = PROBE_EVERY
            self._next_probe = min(self._next_probe, self._steps + PROBE_EVERY)
        elif not probe:
            return batch
        else:  # a probe while drafting does not pay drafts for one request, the best accepted: it re-measures
            # the acceptance and the drafter's time at a fraction of a whole batch's drafting
            chosen = [max(chosen, key=lambda c: self._track(c[0].req).ema)]
        start = time.perf_counter()
        try:
            drafts = self.drafter.propose([s.req for s, _ in chosen], [k for _, k in chosen])
        except Exception as e:  # noqa: BLE001 - a drafter's failure costs this step its drafts, nothing else
            log.warning("drafter %s failed; the step decodes without drafts: %s: %s", self.drafter.name,
                        type(e).__name__, e)
            return batch
        spent = time.perf_counter() - start if self.drafter.draft_seconds is None else self.drafter.draft_seconds
        proposed = sum(len(d) for d in drafts)
        if proposed:
            self.draft_cost.observe(proposed, spent)
        if probe:  # a probe while drafting does not pay comes twice as late next time (it costs the drafter's
            # time); one that found nothing to verify (a draft model still catching up) is tried again next step
            if not pays and proposed:
                self._probe_every = min(PROBE_MAX, 2 * self._probe_every)
            self._next_probe = self._steps + (1 if not pays and not proposed else self._probe_every)
        trees = [self._checked(s.req, d if isinstance(d, DraftTree) else DraftTree.chain(d), k)
                 for (s, k), d in zip(chosen, drafts)]
        if pausing:  # a pausing request's draft goes on only on evidence that drafts of its kind are accepted
            trees = [t if s.req not in pausing or t.evidence in strong else DraftTree.chain([])
                     for (s, _), t in zip(chosen, trees)]
        for (s, _), t in zip(chosen, trees):
            self._track(s.req).evidence = t.evidence
        found = sorted(((self._rates(s.req, t.evidence), s.req, t) for (s, _), t in zip(chosen, trees) if len(t)),
                       key=lambda x: -x[0][0])
        found = [(rates, req, _by_value(tree, rates[1], rates[0])) for rates, req, tree in found]
        if not self._adaptive or (probe and not pays):  # one request's whole draft (a probe that does not pay)
            lengths = [len(t) for _, _, (t, _) in found]
        else:
            lengths = self.cost.trim(len(seqs), [values for _, _, (_, values) in found])
            if probe:  # every request verifies at least its first draft token, so that an acceptance the cuts
                lengths = [max(1, n) for n in lengths]  # keep at zero can recover (whole drafts cost 3x a step)
        kept = {req: t.prefix(n) for (_, req, (t, _)), n in zip(found, lengths) if n}
        return scheduler.with_drafts(batch, {req: (t.tokens, () if t.is_chain else t.parents)
                                             for req, t in kept.items()})

    def _pays(self, decodes: int, chosen: list[tuple[ScheduledSeq, int]]) -> bool:
        """Whether drafting for ``chosen`` is expected to beat plain decoding in tokens per second, the
        drafter's own time included (unknown costs count as zero: drafting explores them)."""
        base = self.cost.estimate(decodes)
        if not self._adaptive or base is None or base <= 0:
            return True
        asked = sum(k for _, k in chosen)
        own = self.draft_cost.estimate(asked) or 0.0
        if own < CHEAP * base:
            return True
        spent = (self.cost.estimate(decodes + asked) or 0.0) + own + sum(self._catch_up(s.req, k) for s, k in chosen)
        tokens = decodes + sum(self._expected(s.req, k) for s, k in chosen)
        return spent <= 0 or tokens / spent > (1 + MARGIN) * decodes / base

    def _catch_up(self, req: Request, k: int) -> float:
        """A step's share of what drafting for ``req`` first costs the drafter: reading the tokens of it not yet
        read (a draft model prefilling the prompt: once per request, so spread over the steps the request has
        left, each expected to give it 1 + its expected accepted drafts). What a verification emits (up to
        k + 1 tokens) is drafting work, counted in the drafter's own time. Without this a draft model on long
        prompts drafted on the promise of its per-token costs and lost: SmolLM2 drafting for itself, float32
        batch 4 on the copy prompts (~1,000 tokens each), 0.87x plain decoding."""
        pending = self.drafter.pending_tokens(req) - (k + 1)
        if pending <= 0 or self.catch_up <= 0:
            return 0.0
        left = max(1, req.max_new_tokens - len(req.output_ids))
        return pending * self.catch_up / max(1.0, left / (1 + self._expected(req, k)))

    def _expected(self, req: Request, k: int) -> float:
        """Expected accepted drafts of a chain of ``k`` for ``req``."""
        first, deep = self._rates(req)
        return expected_accepted(deep, k, first)

    def _checked(self, req: Request, tree: DraftTree, depth: int) -> DraftTree:
        """The draft without the nodes deeper than ``depth``, outside the vocabulary or refused by the request's
        grammar (with their subtrees)."""
        level = depths(tree.parents, len(tree))
        ok = [True] * len(tree)
        keep: list[int] = []
        for i, p in enumerate(tree.parents):
            if level[i] <= depth and 0 <= tree.tokens[i] < self.vocab_size and (p < 0 or ok[p]):
                keep.append(i)
            else:
                ok[i] = False
        tree = tree.keep(keep) if len(keep) < len(tree) else tree
        if len(tree) and req.grammar is not None:
            try:
                tree = tree.keep(self._allowed(req, tree))
            except Exception as e:  # noqa: BLE001 - this request goes without a draft; its grammar is checked again
                log.warning("request %s: its grammar could not check a draft: %s: %s", req.rid, type(e).__name__, e)
                return DraftTree.chain([])
        return tree

    @staticmethod
    def _allowed(req: Request, tree: DraftTree) -> list[int]:
        """The nodes whose paths the request's grammar allows (a chain in one check, a tree one per leaf)."""
        inner = set(tree.parents)
        leaves = [i for i in range(len(tree)) if i not in inner]
        allowed: set[int] = set()
        for leaf in leaves:
            nodes = path(tree.parents, leaf)
            allowed.update(nodes[:req.grammar.valid_prefix([tree.tokens[i] for i in nodes])])
        return sorted(allowed)

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        """A step's time, learnt by its row count when it only decoded (a prefill chunk's time is not a row's)."""
        if all(s.num_tokens == 1 or s.draft for s in batch.seqs):
            self.cost.observe(batch.num_tokens, seconds)

    def verify(self, seq: ScheduledSeq, sampled: list[int]) -> tuple[list[int], list[int]]:
        """The tokens ``seq``'s rows emit and the draft nodes accepted; updates the request's acceptance."""
        if not seq.draft:
            return sampled, []
        out, nodes = walk(seq.draft, seq.parents, sampled)
        track = self._track(seq.req)
        k, hit = max(depths(seq.parents, len(seq.draft))), len(out) - 1
        self.drafted += len(seq.draft)  # draft tokens verified: a tree's every node
        self.accepted += hit
        self.verifications += 1
        rate = hit / min(hit + 1, k)  # per position tried: the one after the last accepted was tried and missed
        track.ema = (1 - EMA) * track.ema + EMA * rate
        self.acceptance = (1 - GLOBAL_EMA) * self.acceptance + GLOBAL_EMA * rate
        track.first = (1 - EMA) * track.first + EMA * (hit > 0)
        self.first = (1 - GLOBAL_EMA) * self.first + GLOBAL_EMA * (hit > 0)
        if track.evidence:
            by = self.first_by_evidence.get(track.evidence, self.first)
            self.first_by_evidence[track.evidence] = (1 - GLOBAL_EMA) * by + GLOBAL_EMA * (hit > 0)
            self.seen_by_evidence[track.evidence] = self.seen_by_evidence.get(track.evidence, 0) + 1
        if hit and k > 1:  # positions 2.. were tried: the one after the last accepted too, unless it was the last
            deep = (hit - 1) / min(hit, k - 1)
            track.deep = (1 - EMA) * track.deep + EMA * deep
            self.deep = (1 - GLOBAL_EMA) * self.deep + GLOBAL_EMA * deep
        if track.ema < MIN_ACCEPT:
            track.pause, track.backoff = track.backoff, min(BACKOFF_MAX, track.backoff * 2)
            track.ema = MIN_ACCEPT  # the probe after the pause starts at the threshold
            track.first = max(track.first, MIN_ACCEPT)
        elif hit == k:
            track.backoff = BACKOFF_MIN
        return out, nodes

    def observe_hidden(self, seqs: list[ScheduledSeq], hidden: torch.Tensor, first_rows: dict[int, int],
                       verified: Verified) -> None:
        """Hand a drafter that reads the target's features each request's rows of this step."""
        for seq, rows in feature_rows(seqs, first_rows, verified):
            try:
                self.drafter.observe_hidden(seq.req, seq.start, hidden[rows])
            except Exception as e:  # noqa: BLE001 - this request's drafts, not the step's
                log.warning("drafter %s could not take request %s's hidden states: %s: %s", self.drafter.name,
                            seq.req.rid, type(e).__name__, e)

    def release(self, req: Request) -> None:
        self.drafter.release(req)
