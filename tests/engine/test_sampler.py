"""Sampling as pure functions: greedy, filters, penalties, seeds that survive batching, logprobs."""
from __future__ import annotations

import torch

from engine.request import Request
from engine.sampler import filter_probs, sample, step_seed
from engine.sampling_params import SamplingParams


def req(rid: str, seed: int | None = None, output: list[int] | None = None, prompt: list[int] | None = None,
        **kw: object) -> Request:
    sp = SamplingParams(seed=seed, **kw)  # type: ignore[arg-type]
    return Request(rid=rid, prompt_ids=prompt or [1, 2], sampling=sp, max_new_tokens=10, seed=seed,
                   output_ids=list(output or []))


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    tokens, _ = sample(logits, [req("a", temperature=0.0), req("b", top_k=1)], gen())
    assert tokens == [1, 0]


def test_a_temperature_below_float32s_range_takes_the_argmax_and_fails_no_row() -> None:
    logits = torch.tensor([[0.5, 3.0, 1.0, -2.0, 2.9], [0.0, 0.0, 4.0, 0.0, 0.0]])
    huge_k = 2**64 + 5  # a top_k past the vocabulary keeps all of it (not 5 once it wraps in a C int64)
    errors: dict[int, Exception] = {}
    tokens, _ = sample(logits, [req("a", temperature=1e-50), req("b", seed=3, top_k=huge_k)], gen(), errors)
    assert not errors and tokens[0] == 1 and 0 <= tokens[1] < 5


def test_filters_keep_exactly_the_nucleus_topk_and_min_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3)
    kept = filter_probs(probs, top_k=torch.tensor([2, 4, 4]), top_p=torch.tensor([1.0, 0.7, 1.0]),
                        min_p=torch.tensor([0.0, 0.0, 0.2]))
    assert (kept > 0).tolist() == [[True, True, False, False], [True, True, False, False],
                                   [True, True, True, False]]


def test_seeded_sampling_is_independent_of_batch_composition() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    alone, _ = sample(logits[1:2].clone(), [req("x", seed=42, temperature=1.0)], gen())
    batched, _ = sample(logits.clone(), [req("a", temperature=1.0), req("x", seed=42, temperature=1.0),
                                         req("b", seed=7, temperature=0.5)], torch.Generator().manual_seed(99))
    assert batched[1] == alone[0]
    other, _ = sample(logits[1:2].clone(), [req("x", seed=43, temperature=1.0)], gen())
    counts = {sample(logits[1:2].clone(), [req("x", seed=s, temperature=1.0)], gen())[0][0] for s in range(40)}
    assert len(counts) > 5, "different seeds explore the distribution"
    del other


def test_step_seed_changes_with_position_and_seed() -> None:
    assert len({step_seed(1, p) for p in range(100)}) == 100
    assert step_seed(1, 5) != step_seed(2, 5) and 0 <= step_seed(2**62, 3) < 2**63


def test_seeded_samples_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    draws = [sample(logits.clone(), [req("x", seed=s, output=[0] * s, temperature=1.0)], gen())[0][0]
             for s in range(600)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert abs(freq[0] - 0.7) < 0.07 and abs(freq[1] - 0.2) < 0.06 and abs(freq[2] - 0.1) < 0.05


def test_penalties_push_down_seen_tokens() -> None:
    logits = torch.tensor([[2.0, 2.0, -1.0, 1.9]])
    tokens, _ = sample(logits.clone(), [req("r", temperature=0.0, repetition_penalty=2.0, prompt=[0],
                                            output=[1])], gen())
    assert tokens == [3]
    tokens, _ = sample(logits.clone(), [req("f", temperature=0.0, frequency_penalty=0.2, output=[0, 0])], gen())
    assert tokens == [1]
    tokens, _ = sample(logits.clone(), [req("p", temperature=0.0, presence_penalty=0.5, output=[0, 1])], gen())
    assert tokens == [3]


def test_logprobs_are_raw_log_softmax_with_top_k() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    _, lps = sample(logits.clone(), [req("a", temperature=0.0, logprobs=2)], gen())
    lp = lps[0]
    expect = torch.log_softmax(logits[0], -1)
    assert lp is not None and lp.token_id == 2 and abs(lp.logprob - expect[2].item()) < 1e-6
    assert [t for t, _ in lp.top] == [2, 1]
