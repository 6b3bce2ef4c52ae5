"""The speculation cost model keeps drafts only while they raise expected tokens per second: all of them when
extra rows are free (a step bound by reading weights), none when every row costs as much as a decode (a step
bound by arithmetic), and the best-accepted few in between; the step time is learnt per row count, read
between counts as a non-decreasing line."""
from __future__ import annotations

import pytest

from engine.spec.cost import TRIM_MARGIN, StepCost, chain_values, expected_accepted, monotone


def learnt(cost_of_rows, margin: float = TRIM_MARGIN) -> StepCost:  # noqa: ANN001 - rows -> seconds
    cost = StepCost(margin=margin)
    for rows in (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144):
        for _ in range(30):
            cost.observe(rows, cost_of_rows(rows))
    return cost


def test_expected_accepted_is_a_geometric_sum() -> None:
    assert expected_accepted(1.0, 4) == 4 and expected_accepted(0.0, 4) == 0
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(0.9, 3, first=0.5) == pytest.approx(0.5 * (1 + 0.9 + 0.81))


def test_a_cost_model_without_data_or_with_one_bucket_explores() -> None:
    assert StepCost().trim(4, [chain_values(0.1, 4)] * 3) == [4, 4, 4]
    one = StepCost()
    one.observe(4, 0.05)
    assert one.trim(4, [chain_values(0.1, 4)] * 3) == [4, 4, 4]


def test_free_rows_keep_every_draft_that_may_be_accepted() -> None:
    cost = learnt(lambda rows: 0.040)
    assert cost.trim(4, [chain_values(0.9, 4), chain_values(0.5, 4), chain_values(0.05, 4)]) == [4, 4, 4]


def test_rows_that_cost_a_decode_each_keep_none() -> None:
    cost = learnt(lambda rows: 0.005 * rows)
    assert cost.trim(16, [chain_values(0.9, 4), chain_values(0.8, 4)]) == [0, 0]


def test_in_between_only_the_well_accepted_drafts_are_kept() -> None:
    cost = learnt(lambda rows: 0.040 + 0.004 * rows)  # a row costs a tenth of a one-row step
    drafts = [chain_values(0.95, 4), chain_values(0.9, 4), chain_values(0.02, 4), chain_values(0.01, 4)]
    assert cost.trim(4, drafts) == [4, 4, 0, 0]


def test_each_draft_is_cut_where_its_next_token_is_too_unlikely_to_pay_for_its_row() -> None:
    """Position i of a draft is accepted with probability rate^i, and a row costs a tenth of a one-row step: a
    lone request keeps positions while their chance beats the step's tokens per row so far, all 8 at 0.95, a few
    at 0.6, one at most at 0.3. Together, positions go where they are likeliest, each draft cut from its end."""
    cost = learnt(lambda rows: 0.040 + 0.004 * rows)
    assert cost.trim(1, [chain_values(0.95, 8)]) == [8]
    assert 2 <= cost.trim(1, [chain_values(0.6, 8)])[0] <= 4
    assert cost.trim(1, [chain_values(0.3, 8)])[0] <= 1
    lengths = cost.trim(1, [chain_values(0.95, 8), chain_values(0.6, 8), chain_values(0.3, 8)])
    assert lengths[0] == 8 and lengths == sorted(lengths, reverse=True) and sum(lengths) < 12, lengths


def test_a_draft_expected_to_gain_less_than_the_margin_is_not_verified() -> None:
    """A row costs a tenth of a step and a lone draft token is accepted 15% of the time: verifying it would raise
    tokens per second by 5% on the estimates, within what they can tell apart, so the step decodes plainly;
    at 60% (a 47% gain) it drafts."""
    def step(rows: int) -> float:
        return 0.040 + 0.004 * rows
    assert learnt(step).trim(1, [chain_values(0.15, 1)]) == [0]
    assert learnt(step, margin=0.0).trim(1, [chain_values(0.15, 1)]) == [1]
    assert learnt(step).trim(1, [chain_values(0.6, 1)]) == [1]


def test_estimates_follow_the_line_of_the_steps_seen() -> None:
    cost = learnt(lambda rows: 0.02 + 0.01 * rows)
    assert cost.estimate(6) == pytest.approx(0.08, rel=0.01)
    assert cost.estimate(300) == pytest.approx(3.02, rel=0.01)


def test_a_few_cheap_steps_are_not_drowned_by_many_drafted_ones() -> None:
    """Flat to 5 rows (bound by reading weights), then 3 ms a row (bound by arithmetic), as measured for SmolLM2
    in float32 at batch 4; most steps seen are drafted ones of 12-20 rows. A single line through them misplaces
    the 4-row step (measured: 42 ms where those steps took 24 ms); per row count it stays 24 ms, and drafts
    accepted 73% of the time no longer all pay."""
    def real(rows: int) -> float:
        return 0.024 + 0.003 * max(0, rows - 5)
    cost = StepCost()
    for i in range(200):
        rows = 4 if i % 10 == 0 else (12, 16, 20)[i % 3]
        cost.observe(rows, real(rows))
    assert cost.estimate(4) == pytest.approx(0.024)
    assert cost.estimate(14) == pytest.approx(real(14), rel=0.05)
    assert sum(cost.trim(4, [chain_values(0.73, 4)] * 4)) < 16


def test_estimates_never_fall_as_rows_grow() -> None:
    cost = StepCost()
    for rows, seconds in ((4, 0.030), (8, 0.020), (16, 0.060)):  # a lucky 8-row step (or a slow 4-row one)
        cost.observe(rows, seconds)
    estimates = [cost.estimate(r) for r in range(1, 40)]
    assert estimates == sorted(estimates)
    assert cost.estimate(4) == cost.estimate(8) == pytest.approx(0.025, rel=0.01)  # pooled, by their weights


def test_one_slow_moment_at_a_rarely_seen_row_count_does_not_raise_the_larger_counts() -> None:
    """A 5-row step seen once while the host was busy (50 ms), 7-11 rows seen often at 35 ms: the fit pools them
    by weight, so a 9-row step stays near 35 ms (the running maximum it replaced put every count up to 11 at 50
    and cut drafts short)."""
    cost = StepCost()
    cost.observe(1, 0.030)
    cost.observe(5, 0.050)
    for i in range(100):
        cost.observe(7 + i % 5, 0.035)
    assert cost.estimate(9) < 0.036 and cost.estimate(5) < 0.036
    estimates = [cost.estimate(r) for r in range(1, 12)]
    assert estimates == sorted(estimates)


def test_a_one_off_slow_step_does_not_make_its_row_count_look_slow() -> None:
    """A row count's first oneDNN call builds its kernel (0.3-0.7 s where the step takes ~10 ms): it counts as
    twice the estimate at most, so the 4-row step stays near 10 ms, not 30."""
    cost = StepCost({1: 0.008, 4: 0.010})
    for _ in range(10):
        cost.observe(4, 0.010)
    cost.observe(4, 0.700)
    assert cost.estimate(4) < 0.012
    for _ in range(100):  # a lasting change is followed (at the mean's pace, twice the estimate a step at most)
        cost.observe(4, 0.050)
    assert cost.estimate(4) > 0.045


def test_the_monotone_fit_pools_only_what_falls() -> None:
    assert monotone([(1, (1.0, 1.0)), (2, (2.0, 1.0)), (3, (3.0, 1.0))]) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert monotone([(1, (1.0, 1.0)), (2, (3.0, 1.0)), (3, (2.0, 3.0)), (4, (5.0, 1.0))]) == \
        [(1, 1.0), (2, 2.25), (3, 2.25), (4, 5.0)]


def test_the_load_time_prior_follows_the_level_of_the_steps_seen() -> None:
    """Timed at load, a forward lacks a real step's sampling and bookkeeping: once plain steps are seen, the
    prior's other row counts move by the same difference, so a verification is not estimated as cheap as a bare
    forward while plain decoding is measured whole."""
    cost = StepCost({1: 0.010, 5: 0.020})
    assert cost.estimate(5) == pytest.approx(0.020) and cost.estimate(3) == pytest.approx(0.015)
    for _ in range(10):
        cost.observe(1, 0.015)
    assert cost.estimate(5) == pytest.approx(0.025) and cost.estimate(1) == pytest.approx(0.015)
    for _ in range(50):
        cost.observe(5, 0.030)  # seen itself: the step's own time wins
    assert cost.estimate(5) == pytest.approx(0.030, rel=0.01)
