"""Speculative decoding changes how many forward passes a request takes, never what it outputs: greedy and seeded
requests give the same tokens (and logprobs, finish reasons, stop-string cuts) with the n-gram drafter, an oracle
drafter (every draft accepted: the forward count drops to 1 + ceil(outputs / (k + 1))) and a random drafter (almost
every draft rejected), in a mixed batch with retraction and aborts; afterwards the pool's integrity check passes
and every page returns. The speculator's cost decisions follow measured step times, so the tests that count
drafts and forwards turn them off (``drafting_always``)."""
from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import SpeculativeConfig
from engine.engine_core import EngineCore
from engine.request import Abort, Request
from engine.sampling_params import SamplingParams
from tests.drafters import CountingForwards, OracleDrafter, RandomDrafter, TreeDrafter, drafting_always
from tests.engine.conftest import make_core

# verification steps of up to 8 x 5 rows: every one on the batch-invariant kernel, whatever this host's
# calibration says (tests/engine/conftest.py)
pytestmark = pytest.mark.usefixtures("float32_rows_on_the_kernel")
K = 4
# the seeded requests' temperature: the random tiny model repeats itself rarely when sampled (at 0.3, 0-8 drafts
# over the 8 requests, depending on the seeds), more often at 0.1 (12-22), so the n-gram drafter has drafts to verify
SEEDED_T = 0.1
NGRAM = SpeculativeConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=K, speculative_ngram_min=1,
                          speculative_ngram_branches=1)


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    """Prompts that repeat a phrase (so the n-gram drafter finds matches) with varied lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(10, 2000) for _ in range(rng.randrange(3, 12))]
        out.append([rng.randrange(10, 2000) for _ in range(i)] + phrase * rng.randrange(2, 6))
    return out


def params(i: int, temperature: float = 0.0) -> SamplingParams:
    """A mix: lengths from 3 to 60 tokens, a frequency penalty, top-p, seeds for sampled requests."""
    return SamplingParams(max_new_tokens=[3, 60, 17, 41, 8, 33, 60, 25][i % 8], temperature=temperature,
                          top_p=0.9 if temperature else 1.0, seed=1000 + i if temperature else None,
                          frequency_penalty=0.5 if i % 3 == 1 else 0.0, ignore_eos=True)


def run(core: EngineCore, ps: list[list[int]], sps: list[SamplingParams], detokenize: bool = False,
        abort_after: int | None = None) -> list[Request]:
    reqs = [core.make_request(p, sp, rid=f"r{i}", detokenize=detokenize) for i, (p, sp) in enumerate(zip(ps, sps))]
    for r in reqs:
        core.add_request(r)
    for step in range(10_000):
        if all(r.finished for r in reqs):
            break
        if step == abort_after:
            for r in reqs[::3]:
                core.abort(r.rid, Abort(499, "client went away"))
        core.step()
    assert all(r.finished for r in reqs)
    core.check_integrity()
    core.flush_cache()
    assert core.allocator.available == core.allocator.capacity, "a page leaked"
    return reqs


def outcome(reqs: list[Request]) -> list[tuple]:
    return [(r.output_ids, r.finish_reason) for r in reqs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, float32_rows_on_the_kernel: None) -> dict[float, list[Request]]:
    ps = prompts(8)
    return {t: run(make_core(tiny_model_dir), ps, [params(i, t) for i in range(8)]) for t in (0.0, SEEDED_T)}


def drafter_for(name: str, ref: list[Request]):  # noqa: ANN201
    truth = {r.rid: r.output_ids for r in ref}
    return {"ngram": None, "ngram-tree": None, "oracle": OracleDrafter(truth), "random": RandomDrafter(4000),
            "tree": TreeDrafter(truth, 4000)}[name]


def speculation_for(name: str) -> SpeculativeConfig:
    return replace(NGRAM, speculative_ngram_branches=3) if name == "ngram-tree" else NGRAM


@pytest.mark.parametrize("temperature", [0.0, SEEDED_T], ids=["greedy", "seeded"])
@pytest.mark.parametrize("drafter", ["ngram", "ngram-tree", "oracle", "random", "tree"])
@pytest.mark.parametrize("pool", [8192, 160], ids=["roomy", "tight"])
def test_output_is_identical_with_every_drafter(tiny_model_dir: Path, reference: dict, drafter: str,
                                                temperature: float, pool: int) -> None:
    ref = reference[temperature]
    core = make_core(tiny_model_dir, max_total_tokens=pool, speculative=drafting_always(speculation_for(drafter)),
                     drafter=drafter_for(drafter, ref))
    forwards = CountingForwards(core)
    got = run(core, prompts(8), [params(i, temperature) for i in range(8)])
    assert outcome(got) == outcome(ref)
    if pool == 160:
        assert core.scheduler.num_retractions > 0, "the tight pool was meant to retract"
    spec = core.spec
    assert spec.drafted > 0, "drafts were verified"
    if drafter == "oracle":
        assert spec.accepted == spec.drafted
    if drafter in ("oracle", "tree") and pool == 8192:  # the longest request (60 tokens) bounds the step count
        assert forwards.count <= 2 + -(-59 // (K + 1)), "accepted drafts must replace forward passes"
    if drafter == "random":
        assert spec.accepted <= spec.drafted // 10


def test_a_lone_request_with_an_oracle_takes_one_forward_per_k_plus_one_tokens(tiny_model_dir: Path,
                                                                               reference: dict) -> None:
    ref = reference[0.0][1]  # 60 tokens
    core = make_core(tiny_model_dir, speculative=drafting_always(NGRAM), drafter=OracleDrafter({"r0": ref.output_ids}))
    forwards = CountingForwards(core)
    (got,) = run(core, [ref.prompt_ids], [ref.sampling])
    assert got.output_ids == ref.output_ids
    assert forwards.count == 1 + -(-(60 - 1) // (K + 1))  # the prefill gives the first token


@pytest.mark.parametrize("page", [4, 512], ids=["native-kernel", "torch-gather"])
def test_a_tree_draft_accepts_the_branch_the_target_agrees_with(tiny_model_dir: Path, reference: dict,
                                                               page: int) -> None:
    """The target's continuation is the second branch of every tree (after a heavier random one): each step
    accepts it whole, the accepted path's K/V moves to where a chain's would be, and the output is plain
    decoding's. Page size 512 is beyond the native kernel, so the torch gather path attends over the paths."""
    ref = reference[0.0][1]  # 60 tokens
    core = make_core(tiny_model_dir, page_size=page, max_total_tokens=4096, speculative=drafting_always(NGRAM),
                     drafter=TreeDrafter({"r0": ref.output_ids}, 4000))
    assert (core.runner.backend._native is None) == (page == 512)
    forwards = CountingForwards(core)
    moved: list[int] = []
    settle = core.runner.settle_draft
    core.runner.settle_draft = lambda seq, moves: (moved.append(len(moves)), settle(seq, moves))
    (got,) = run(core, [ref.prompt_ids], [ref.sampling])
    assert got.output_ids == ref.output_ids
    assert forwards.count == 1 + -(-(60 - 1) // (K + 1))
    assert moved and min(moved) > 0, "the accepted branch sat behind another one in storage"


def test_aborting_speculating_requests_leaves_no_page_behind(tiny_model_dir: Path, reference: dict) -> None:
    ref = reference[0.0]
    core = make_core(tiny_model_dir, speculative=NGRAM, drafter=drafter_for("oracle", ref))
    got = run(core, prompts(8), [params(i) for i in range(8)], abort_after=4)
    for i, r in enumerate(got):
        if i % 3 == 0 and r.finish_reason == "abort":
            assert r.output_ids == ref[i].output_ids[:len(r.output_ids)]
        else:
            assert (r.output_ids, r.finish_reason) == (ref[i].output_ids, ref[i].finish_reason)


def test_stop_tokens_and_strings_inside_a_verified_draft_end_where_plain_decoding_ends(tiny_model_dir: Path) -> None:
    plain = make_core(tiny_model_dir)
    prompt = prompts(1, seed=5)[0]
    free = run(plain, [prompt], [SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)],
               detokenize=True)[0]
    text = free.detok.text
    stop_string = text[len(text) // 2:len(text) // 2 + 2]
    stop_token = free.output_ids[23]
    cases = [SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, stop=[stop_string], logprobs=0),
             SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_token],
                            logprobs=0)]
    for sp in cases:
        (want,) = run(make_core(tiny_model_dir), [prompt], [sp], detokenize=True)
        core = make_core(tiny_model_dir, speculative=NGRAM, drafter=OracleDrafter({"r0": free.output_ids}))
        (got,) = run(core, [prompt], [sp], detokenize=True)
        assert want.finish_reason == "stop" and len(want.output_ids) < 40
        assert (got.output_ids, got.finish_reason, got.finish_detail, got.detok.text) == (
            want.output_ids, want.finish_reason, want.finish_detail, want.detok.text)
        assert [lp.token_id for lp in got.output_logprobs] == got.output_ids, "one logprob per emitted token"


def test_logprobs_of_accepted_tokens_equal_plain_decoding(tiny_model_dir: Path, reference: dict) -> None:
    ref = reference[0.0]
    ps, sps = prompts(8), [SamplingParams(**{**vars(params(i)), "logprobs": 3}) for i in range(8)]
    want = run(make_core(tiny_model_dir), ps, sps)
    got = run(make_core(tiny_model_dir, speculative=NGRAM, drafter=drafter_for("oracle", ref)), ps, sps)
    for w, g in zip(want, got):
        assert g.output_ids == w.output_ids and len(g.output_logprobs) == len(w.output_logprobs)
        for a, b in zip(w.output_logprobs, g.output_logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("drafter", ["oracle", "random", "tree"])
def test_constrained_requests_draft_only_what_their_grammar_allows(tiny_model_dir: Path, drafter: str) -> None:
    """A regex-constrained batch (the grammar completes inside verified runs; ignore_eos, so only the grammar
    ends them) gives the same text with drafts: oracle drafts pass the grammar and are all accepted, random ones
    are cut at the first token the grammar refuses before they are verified."""
    import re

    from engine.grammar.spec import GrammarSpec
    from tests.engine.test_constrained_decoding import WORDS, constrained

    spec = GrammarSpec.of_text("regex", WORDS, "regex")

    def batch(core: EngineCore) -> list[Request]:
        rng = random.Random(5)
        reqs = [constrained(core, [rng.randrange(10, 4000) for _ in range(20)], spec, temperature=0.3, seed=i,
                            ignore_eos=True) for i in range(6)]
        for i, r in enumerate(reqs):
            r.rid = f"r{i}"
        core.run_to_completion(reqs)
        core.check_integrity()
        core.flush_cache()
        assert core.allocator.available == core.allocator.capacity
        return reqs

    want = batch(make_core(tiny_model_dir, jump_forward=False))
    assert all(re.fullmatch(WORDS, r.detok.text) and r.finish_reason == "stop" for r in want)
    core = make_core(tiny_model_dir, jump_forward=False, speculative=drafting_always(NGRAM),
                     drafter=drafter_for(drafter, want) if drafter != "random" else RandomDrafter(4000, seed=2))
    got = batch(core)
    assert [(r.output_ids, r.detok.text, r.finish_reason) for r in got] == [
        (r.output_ids, r.detok.text, r.finish_reason) for r in want]
    assert core.spec.drafted > 0
    if drafter == "oracle":
        assert core.spec.accepted == core.spec.drafted
    if drafter == "tree":  # the random branches are cut where the grammar refuses them, the oracle's kept
        assert core.spec.accepted > core.spec.drafted // 3


class _Failing(OracleDrafter):
    def propose(self, reqs, limits):  # noqa: ANN001, ANN201
        if any(len(r.output_ids) == 7 for r in reqs):
            raise RuntimeError("drafter bug")
        return [[d if i % 2 else 10 ** 9 for i, d in enumerate(ds)] for ds in super().propose(reqs, limits)]


def test_a_failing_drafter_or_an_out_of_vocabulary_draft_fails_no_request(tiny_model_dir: Path,
                                                                          reference: dict) -> None:
    """A drafter that raises costs its step the drafts; a draft token outside the vocabulary ends the draft."""
    ref = reference[0.0]
    core = make_core(tiny_model_dir, speculative=NGRAM, drafter=_Failing({r.rid: r.output_ids for r in ref}))
    got = run(core, prompts(8), [params(i) for i in range(8)])
    assert outcome(got) == outcome(ref)
