"""At load, a speculating engine times plain and verified steps (and a draft model's forward and its reading of a
prompt) over scratch pages, so its first decisions follow this host's costs: every timed shape is in the cost
model before the first request, the pools are idle afterwards, a drafter timed as too slow to ever pay does not
draft at all (not even to probe), a probe while drafting does not pay drafts for one request only, and
``--speculative-policy acceptance`` drafts regardless of the costs."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.config import EngineConfigError, SpeculativeConfig
from engine.sampling_params import SamplingParams
from engine.spec import CostPrior, Speculator
from engine.spec.prior import BATCHES
from tests.drafters import RandomDrafter
from tests.engine.conftest import make_core
from tests.engine.test_draft_model_speculation_is_lossless import draft_config, draft_pool_idle

K = 4
CFG = SpeculativeConfig(speculative_algorithm="ngram", speculative_num_draft_tokens=K)


def test_every_timed_shape_is_known_before_the_first_request(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir, speculative=CFG)
    assert core.allocator.available == core.allocator.capacity
    core.check_integrity()
    spec = core.spec
    assert spec.best_gain is not None and spec.best_gain > 0
    for rows in (b * r for b in BATCHES for r in (1, 1 + K)):
        assert rows in spec.cost._prior, f"a {rows}-row step was not timed"
    assert not spec.draft_cost._prior, "the n-gram drafter runs no forward to time"
    assert spec.catch_up == 0.0, "nor reads a prompt before drafting"


def test_a_draft_models_forward_is_timed_too_and_both_pools_stay_idle(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir, speculative=draft_config(tiny_model_dir, K))
    spec = core.spec
    assert sorted(spec.draft_cost._prior) == [b * K for b in BATCHES]
    assert all(seconds > 0 for seconds in spec.draft_cost._prior.values())
    assert spec.best_gain is not None and spec.best_gain > 0  # its value is a timing: not asserted
    assert spec.catch_up > 0, "reading a prompt into the draft model was timed"
    assert core.allocator.available == core.allocator.capacity
    draft_pool_idle(core)
    req = core.make_request(list(range(10, 60)), SamplingParams(max_new_tokens=1), detokenize=False)
    assert core.spec.drafter.pending_tokens(req) == 50, "a request the draft model never saw: all of it"


class _TimedSlow(RandomDrafter):
    """Random drafts that cost nothing to propose but were timed at load at 100 s a forward."""

    name = "timed-slow"

    def __init__(self) -> None:
        super().__init__(100)
        self.sizes: list[int] = []

    def time_forward(self) -> dict[int, float]:
        return {1: 100.0, 4: 100.0}

    def propose(self, reqs, limits):  # noqa: ANN001, ANN201
        self.sizes.append(len(reqs))
        return super().propose(reqs, limits)


@pytest.mark.parametrize("policy", ["adaptive", "acceptance"])
def test_a_drafter_timed_too_slow_to_pay_drafts_only_under_the_acceptance_policy(tiny_model_dir: Path,
                                                                                policy: str) -> None:
    drafter = _TimedSlow()
    core = make_core(tiny_model_dir, speculative=dataclasses.replace(CFG, speculative_policy=policy),
                     drafter=drafter)
    assert core.spec.best_gain is not None and core.spec.best_gain < 0.1
    assert core.spec.hopeless == (policy == "adaptive")
    req = core.make_request([5, 6, 7, 8], SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True),
                            detokenize=False)
    core.run_to_completion([req])
    assert len(req.output_ids) == 400
    if policy == "adaptive":
        assert drafter.sizes == [], f"{len(drafter.sizes)} proposals from a drafter that cannot pay"
    else:  # random drafts are rejected, so acceptance pauses it (ever longer), but it keeps coming back
        assert len(drafter.sizes) >= 3
    core.check_integrity()


class _Costly(RandomDrafter):
    """Random drafts reporting 0.2 s of drafting each (measured, not timed at load: the gate opens at first)."""

    name = "costly"
    draft_seconds = 0.2

    def __init__(self) -> None:
        super().__init__(100)
        self.sizes: list[int] = []

    def propose(self, reqs, limits):  # noqa: ANN001, ANN201
        self.sizes.append(len(reqs))
        return super().propose(reqs, limits)


def test_a_probe_while_drafting_does_not_pay_drafts_for_one_request(tiny_model_dir: Path) -> None:
    drafter = _Costly()
    core = make_core(tiny_model_dir, speculative=CFG, drafter=drafter)
    reqs = [core.make_request([5, 6, 7, 8 + i], SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True),
                              detokenize=False) for i in range(4)]
    core.run_to_completion(reqs)
    assert drafter.sizes[0] == 4, "the first step drafts for every request (the drafter's cost is not known)"
    assert len(drafter.sizes) >= 2 and set(drafter.sizes[1:]) == {1}, drafter.sizes
    core.check_integrity()
    core.flush_cache()
    assert core.allocator.available == core.allocator.capacity


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(EngineConfigError, match="--speculative-policy"):
        Speculator(dataclasses.replace(CFG, speculative_policy="always"), RandomDrafter(100), 100)


def test_the_best_gain_counts_every_draft_forward_and_the_verification() -> None:
    prior = CostPrior(target={1: 0.010, 5: 0.015}, draft={1: 0.002}, k=4)
    assert prior.best_gain() == pytest.approx(5 * 0.010 / (4 * 0.002 + 0.015))
    assert CostPrior(target={1: 0.010}, draft={}, k=4).best_gain() is None  # the verified shape did not fit
