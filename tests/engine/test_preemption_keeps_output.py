"""A request retracted when pages run out produces exactly the output it would have produced without
preemption (greedy and seeded sampling), and the pool returns to its idle size."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.sampling_params import SamplingParams
from tests.engine.conftest import make_core


def run(model_dir: Path, max_total_tokens: int, temperature: float) -> tuple[list[list[int]], int]:
    core = make_core(model_dir, page_size=4, max_total_tokens=max_total_tokens, chunk=16)
    rng = random.Random(3)
    reqs = [core.make_request([rng.randrange(10, 4000) for _ in range(20)],
                              SamplingParams(max_new_tokens=40, temperature=temperature, top_p=0.9, seed=100 + i,
                                             ignore_eos=True), detokenize=False) for i in range(8)]
    core.run_to_completion(reqs)
    core.check_integrity()
    core.flush_cache()
    assert core.allocator.available == core.allocator.capacity
    return [r.output_ids for r in reqs], core.scheduler.num_retractions


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_retracted_requests_finish_with_the_same_tokens(tiny_model_dir: Path, temperature: float) -> None:
    roomy, retracted_roomy = run(tiny_model_dir, 8192, temperature)
    tight, retracted_tight = run(tiny_model_dir, 256, temperature)  # 8 x 60 tokens do not fit in 256
    assert retracted_roomy == 0 and retracted_tight > 0
    assert tight == roomy


def test_disabled_radix_cache_never_reuses_and_keeps_nothing(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir, disable_radix_cache=True)
    prompt = list(range(10, 60))
    reqs = [core.make_request(prompt, SamplingParams(max_new_tokens=5, temperature=0), detokenize=False)
            for _ in range(2)]
    core.run_to_completion(reqs[:1])
    core.run_to_completion(reqs[1:])
    assert [r.cached_tokens for r in reqs] == [0, 0] and reqs[0].output_ids == reqs[1].output_ids
    assert core.allocator.available == core.allocator.capacity  # nothing cached, nothing held
