"""The speculator's policy, fed known costs: a drafter with a time of its own drafts only while its drafts are
expected to raise tokens per second with that time counted (a slow draft model with middling acceptance does not;
a fast one does; a drafter costing next to nothing is left to the per-draft choice; one that must first read a
long prompt drafts only for a request with output enough left to repay it), and a new request's acceptance prior
is the acceptance seen over all requests so far."""
from __future__ import annotations

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.spec import Speculator
from engine.spec.cost import StepCost
from engine.spec.speculator import STRONG_SEEN, _by_value
from engine.spec.tree import DraftTree
from tests.drafters import CountingForwards, OracleDrafter, RandomDrafter, drafting_always
from tests.engine.test_spec_cost_model import learnt

CFG = SpeculativeConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=4)


def request(rid: str) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(temperature=0), 64, output_ids=[8])


def speculator(step_seconds: float, draft_seconds: float) -> Speculator:
    spec = Speculator(CFG, RandomDrafter(100), 100)
    spec.cost = learnt(lambda rows: step_seconds)  # a step bound by reading weights: rows are free
    for _ in range(20):
        spec.draft_cost.observe(4, draft_seconds)
    return spec


def accepting(spec: Speculator, req: Request, rate: float) -> None:
    """Make ``req``'s acceptance ``rate`` at every draft position."""
    track = spec._track(req)
    track.ema = track.first = track.deep = rate


def decoding(req: Request) -> ScheduledSeq:
    return ScheduledSeq(req, req.seq_len - 1, 1, sample=True)


def test_a_slow_drafter_drafts_only_when_acceptance_pays_for_it() -> None:
    slow = speculator(0.040, 0.200)  # four draft tokens cost five target steps
    req = request("a")
    accepting(slow, req, 0.9)  # ~3.1 tokens expected per verification: not worth 0.24 s against 0.04 s a token
    assert not slow._pays(1, [(decoding(req), 4)])
    fast = speculator(0.040, 0.030)
    accepting(fast, req, 0.9)
    assert fast._pays(1, [(decoding(req), 4)])
    accepting(fast, req, 0.05)  # almost nothing accepted: even a fast drafter does not pay
    assert not fast._pays(1, [(decoding(req), 4)])


def test_a_drafter_that_costs_next_to_nothing_is_left_to_the_per_draft_choice() -> None:
    cheap = speculator(0.040, 0.0005)
    req = request("a")
    accepting(cheap, req, 0.01)
    assert cheap._pays(1, [(decoding(req), 4)])


def test_a_new_request_starts_from_the_acceptance_seen_so_far() -> None:
    spec = speculator(0.040, 0.0005)
    assert spec._track(request("first")).ema == 1.0
    for i in range(40):  # every draft rejected: the target sampled other tokens
        req = request(f"r{i}")
        seq = ScheduledSeq(req, req.seq_len - 1, 5, sample=True, draft=(1, 2, 3, 4))
        assert spec.verify(seq, [9, 9, 9, 9, 9])[0] == [9]
    assert spec._track(request("late")).ema < 0.2 and spec._rates(request("later"))[0] < 0.2


class _Costly(RandomDrafter):
    """Random drafts that report 0.2 s of drafting each (far more than a tiny-model step)."""

    name = "costly"
    draft_seconds = 0.2

    def __init__(self) -> None:
        super().__init__(100)
        self.calls = 0

    def propose(self, reqs, limits):  # noqa: ANN001, ANN201
        self.calls += 1
        return super().propose(reqs, limits)


def test_a_drafter_that_does_not_pay_is_probed_ever_more_rarely(tiny_model_dir) -> None:  # noqa: ANN001
    from tests.engine.conftest import make_core

    drafter = _Costly()
    core = make_core(tiny_model_dir, speculative=CFG, drafter=drafter)
    req = core.make_request([5, 6, 7, 8], SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True),
                            detokenize=False)
    core.run_to_completion([req])
    # the first step or two draft (no cost known yet, or only a cold first step's); then the probes at decode
    # steps 64 and 192 (64 + 128), where a fixed interval would probe at 64, 128, ..., 384 (six times)
    assert drafter.calls <= 4, f"{drafter.calls} proposals in 400 steps"
    assert len(req.output_ids) == 400


class _CatchingUp(_Costly):
    """Like _Costly, but its first proposal at a probe finds nothing to offer (a draft model still prefilling
    what it missed while the gate was shut)."""

    def __init__(self, core_steps) -> None:  # noqa: ANN001 - returns the speculator's step count
        super().__init__()
        self.steps = core_steps
        self.at: list[int] = []

    def propose(self, reqs, limits):  # noqa: ANN001, ANN201
        self.at.append(self.steps())
        drafts = super().propose(reqs, limits)
        return [[] for _ in reqs] if self.at[-1] == 64 else drafts


def test_a_probe_that_found_nothing_to_verify_is_retried_on_the_next_step(tiny_model_dir) -> None:  # noqa: ANN001
    from tests.engine.conftest import make_core

    holder: list = []
    drafter = _CatchingUp(lambda: holder[0].spec._steps)
    core = make_core(tiny_model_dir, speculative=CFG, drafter=drafter)
    holder.append(core)
    req = core.make_request([5, 6, 7, 8], SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True),
                            detokenize=False)
    core.run_to_completion([req])
    assert 64 in drafter.at and 65 in drafter.at, drafter.at
    assert 128 not in drafter.at, "the retried probe, not the empty one, sets the next interval"


def test_acceptance_is_counted_per_draft_position_tried() -> None:
    """1 of 8 drafts accepted, every time: the 2nd position was tried and missed, so the rate is 1/2 (the chance a
    draft token is accepted after an accepted one), not 1/8, and the request keeps drafting."""
    spec = Speculator(SpeculativeConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=8),
                      RandomDrafter(100), 100)
    req = request("a")
    for _ in range(12):
        seq = ScheduledSeq(req, req.seq_len - 1, 9, sample=True, draft=(1,) * 8)
        assert spec.verify(seq, [1, 9, 9, 9, 9, 9, 9, 9, 9])[0] == [1, 9]
    track = spec._track(req)
    assert track.pause == 0 and abs(track.ema - 0.5) < 0.01
    for _ in range(3):  # nothing accepted: now it pauses
        spec.verify(ScheduledSeq(req, req.seq_len - 1, 9, sample=True, draft=(1,) * 8), [9] * 9)
    assert track.pause > 0


def test_a_copy_that_either_misses_its_first_token_or_runs_to_the_end_keeps_its_long_drafts() -> None:
    """Copying text: a draft's first token is right half the time, and once it is, the rest follows (the model is
    repeating a passage). One rate per position (the average, ~0.5) would value the 8th token at 0.5^8 and cut
    the draft to a token or two; the first token's rate and the later ones' given it, tracked apart, value it
    at 0.5 x 1^7, and where a row costs a tenth of a step the whole draft is verified."""
    spec = Speculator(SpeculativeConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=8),
                      RandomDrafter(100), 100)
    spec.cost = learnt(lambda rows: 0.040 + 0.004 * rows)
    req = request("a")
    for i in range(40):
        seq = ScheduledSeq(req, req.seq_len - 1, 9, sample=True, draft=(1,) * 8)
        spec.verify(seq, [1] * 9 if i % 2 else [9] * 9)
    first, deep = spec._rates(req)
    assert 0.35 < first < 0.65 and deep > 0.99
    assert spec._expected(req, 8) > 3.0
    tree, values = _by_value(DraftTree.chain([1] * 8), deep, first)
    assert values[-1] > 0.3 and spec.cost.trim(1, [values]) == [8]


def test_a_draft_is_priced_by_what_drafts_of_its_evidence_did() -> None:
    """Prompt lookup after a 1-token match is a guess, after a 4-token match usually a copy: with drafts of both
    kinds verified in turn (the 1-token ones always missing, the 4-token ones always accepted), a request's next
    draft is priced by its own kind, so where a row costs a tenth of a step a long-match draft is verified whole
    and a short-match one not at all."""
    spec = Speculator(SpeculativeConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=8),
                      RandomDrafter(100), 100)
    spec.cost = learnt(lambda rows: 0.040 + 0.004 * rows)
    req = request("a")
    for i in range(200):
        spec._track(req).evidence = 4 if i % 2 else 1
        seq = ScheduledSeq(req, req.seq_len - 1, 9, sample=True, draft=(1,) * 8)
        spec.verify(seq, [1] * 9 if i % 2 else [9] * 9)
    (weak, _), (strong, deep) = spec._rates(req, 1), spec._rates(req, 4)
    assert weak < 0.1 < 0.9 < strong and deep > 0.99
    assert 0.3 < spec._rates(req)[0] < 0.7  # no evidence: the request's own average
    for first, kept in ((weak, 0), (strong, 8)):
        _, values = _by_value(DraftTree.chain([1] * 8), deep, first)
        assert spec.cost.trim(1, [values]) == [kept]


class _Frozen(StepCost):
    """A cost model that keeps the costs it was taught (the tiny model's real steps would flatten them)."""

    frozen = False

    def observe(self, rows: int, seconds: float) -> None:
        if not self.frozen:
            super().observe(rows, seconds)


def test_a_probe_where_rows_cost_a_decode_each_verifies_one_draft_token_per_request(
        tiny_model_dir) -> None:  # noqa: ANN001
    from tests.engine.conftest import make_core

    core = make_core(tiny_model_dir, speculative=CFG, drafter=RandomDrafter(100))
    cost = _Frozen()
    for rows in (1, 2, 4, 8, 16, 32):
        for _ in range(30):
            cost.observe(rows, 0.005 * rows)
    cost.frozen = True
    core.spec.cost = cost
    lengths: list[int] = []
    verify = core.spec.verify

    def recording(seq, sampled):  # noqa: ANN001, ANN202
        if seq.draft:
            lengths.append(len(seq.draft))
        return verify(seq, sampled)
    core.spec.verify = recording
    reqs = [core.make_request([5, 6, 7, 8 + i], SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True),
                              detokenize=False) for i in range(4)]
    core.run_to_completion(reqs)
    # no draft is worth a row that costs a decode (not even the first, with every first token taken for accepted
    # and later ones for coin flips), so only the probes every 64 steps verify: one token per request at each of
    # the 4 probes, where whole drafts would be four
    assert len(lengths) >= 12 and set(lengths) == {1}, lengths
    core.check_integrity()


class CatchingUp(RandomDrafter):
    """A drafter that has read none of a request's tokens and reads them at ``per_token`` seconds each."""

    def __init__(self, per_token: float) -> None:
        super().__init__(100)
        self.per_token = per_token

    def time_catch_up(self) -> float:
        return self.per_token

    def pending_tokens(self, req: Request) -> int:
        return req.seq_len


def test_a_drafter_that_must_first_read_a_long_prompt_drafts_only_for_a_long_output() -> None:
    from engine.spec.prior import CostPrior

    def spec_for(per_token: float) -> Speculator:
        spec = Speculator(CFG, CatchingUp(per_token), 100, CostPrior({1: 0.010, 5: 0.011}, {1: 0.004}, 4, per_token))
        for _ in range(20):
            spec.draft_cost.observe(4, 0.016)
        return spec
    # a draft forward of 4 ms, 4 drafts all but surely accepted: 5 tokens for 27 ms against 10 ms a token
    short = Request("short", [5] * 1000, SamplingParams(temperature=0), 64, output_ids=[8])
    long = Request("long", [5] * 1000, SamplingParams(temperature=0), 4096, output_ids=[8])
    ready = Request("ready", [5, 6, 7], SamplingParams(temperature=0), 64, output_ids=[8])
    spec = spec_for(0.0003)  # 0.3 s to read a 1,000-token prompt
    for req in (short, long, ready):
        accepting(spec, req, 0.95)
    assert not spec._pays(1, [(decoding(short), 4)]), "63 tokens left cannot repay the prompt's reading"
    assert spec._pays(1, [(decoding(long), 4)]), "4,095 tokens left can"
    assert spec._pays(1, [(decoding(ready), 4)]), "a prompt of 3 tokens is drafting work, not catching up"
    free = spec_for(0.0)
    accepting(free, short, 0.95)
    assert free._pays(1, [(decoding(short), 4)])


class _OracleWithEvidence(OracleDrafter):
    """The oracle's drafts, tagged with the evidence prompt lookup would give them (``evidence``)."""

    evidence = 0

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int] | DraftTree]:
        return [DraftTree.chain(d, self.evidence) for d in super().propose(reqs, limits)]


def test_a_pausing_request_drafts_again_on_evidence_that_such_drafts_are_accepted(
        tiny_model_dir) -> None:  # noqa: ANN001
    """A request pausing after misses (copying stopped) still proposes with a drafter that costs nothing to ask,
    and verifies the drafts whose kind of evidence is accepted over all requests (a long lookup match: copying
    resumed), not those of a kind that mostly misses or was seen too rarely to tell: with every draft correct, the
    strong kind cuts the forwards to about a fifth, the others leave one forward a token."""
    from tests.engine.conftest import make_core

    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    plain = make_core(tiny_model_dir)
    truth = {}
    cases = (("weak", 1), ("strong", 4), ("unproven", 3))
    for rid, _ in cases:
        req = plain.make_request([5, 6, 7, 8], params, detokenize=False, rid=rid)
        plain.run_to_completion([req])
        truth[rid] = req.output_ids
    drafter = _OracleWithEvidence(truth)
    core = make_core(tiny_model_dir, speculative=drafting_always(CFG), drafter=drafter)
    # known costs, so that the drafter is the cheap kind whatever the host's timings (the tiny model's steps take
    # about a millisecond, and a loaded host's proposal times come near the 5% that makes a drafter cheap)
    step, draft = _Frozen(), _Frozen()
    for rows in (1, 2, 4, 8):
        step.observe(rows, 0.010)
        draft.observe(rows, 1e-5 * rows)
    step.frozen = draft.frozen = True
    core.spec.cost, core.spec.draft_cost = step, draft
    forwards = CountingForwards(core)
    for rid, evidence in cases:
        core.spec.first_by_evidence = {1: 0.2, 4: 0.9, 3: 0.9}
        core.spec.seen_by_evidence = {1: 100, 4: 100, 3: STRONG_SEEN - 1}
        drafter.evidence = evidence
        req = core.make_request([5, 6, 7, 8], params, detokenize=False, rid=rid)
        core.add_request(req)
        while not req.output_ids:
            core.step()
        core.spec._track(req).pause = 1000
        before = forwards.count
        while not req.finished:
            core.step()
        assert req.output_ids == truth[rid]
        steps = forwards.count - before
        assert (steps <= 12) if rid == "strong" else (steps >= 39), (rid, steps)
    core.check_integrity()
