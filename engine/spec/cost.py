"""When drafts pay: a verification adds rows to the step, and a step's time grows with its rows. While the step
is bound by reading the weights (few rows), extra rows are almost free; once it is bound by arithmetic (many
rows; on 2 CPU cores in float32 already from about 8 rows), every row costs about as much as a decoding request,
and drafts that are not nearly all accepted make the step slower per token than plain decoding.

``StepCost`` learns the step time per row count: an exponentially weighted mean for each count seen (so it follows
the load of the moment), read between counts by linear interpolation and fitted non-decreasing in the rows
(``monotone``, by weight); beyond the largest count seen it extends the slope of the last two. A single line through
all steps (the first model) was wrong where it mattered: fitted mostly on drafted steps of 12-20 rows, it put a
4-row step at 42 ms where such steps took 24 ms (SmolLM2, float32, batch 4), so drafting looked better than it was.
No per-machine constant is assumed. ``trim`` cuts each draft to the length that, over the whole step, maximises
expected tokens per second: (decodes + expected accepted drafts) / time(rows), a request's i-th draft token counting
the chance it and the ones before it are accepted (so a well-accepted request keeps a long draft and a doubtful one
a short one; the choice before it kept or dropped each request's whole draft). Until steps of more than one row
count were seen, extra rows are taken as free (so drafting starts by exploring); the speculator also verifies a
draft token of every drafted request on one step in ``PROBE_EVERY``, so the cost of extra rows keeps being measured."""
from __future__ import annotations

import bisect

DECAY = 0.98  # weight kept by the older steps at each new one (a memory of ~50 decode steps per row count)
FORGET = 1e-3  # a row count whose weight decayed below this is forgotten
# a step over this many times the estimate for its row count is counted as this many times it: one-offs (a row
# count's first oneDNN call building its kernel, a collection pause) took 0.3-0.7 s where such steps take 10-60 ms
# (SmolLM2 bfloat16, batch 4), and one such step in a mean of ten put a 4-row step at 30 ms, measured 9.4
OUTLIER = 2.0
PRIOR_WEIGHT = 1.0  # a row count timed at load weighs in its monotone fit as one step seen
# drafts expected to raise a step's tokens per second by less than this are not verified: the estimates (step
# times learnt online on a noisy host, acceptance averages) are not better than that, and a group of requests
# ends with its slowest, so a small expected gain was a measured loss (SmolLM2 bfloat16 batch 4 copy: 0.93-0.95x
# with drafts priced per position, every step drafting 1-4 tokens a request)
TRIM_MARGIN = 0.10
TIE = 1e-9  # expected tokens per second this close to the best count's is a tie (float rounding)


def expected_accepted(rate: float, drafted: int, first: float | None = None) -> float:
    """Expected accepted drafts of ``drafted`` when each is accepted with probability ``rate`` given the ones
    before it were, the first with probability ``first`` (default ``rate``): first * (1 + rate + ... +
    rate^(drafted - 1))."""
    return (rate if first is None else first) * sum(rate ** i for i in range(drafted))


def chain_values(rate: float, length: int) -> list[float]:
    """A chain draft's positions by their expected acceptance: rate, rate^2, ..., rate^length."""
    return [rate ** i for i in range(1, length + 1)]


def monotone(points: list[tuple[int, tuple[float, float]]]) -> list[tuple[int, float]]:
    """The non-decreasing fit of (rows, (seconds, weight)) points, sorted by rows, closest in weighted squares
    (pool adjacent violators): where a row count measured slower than a larger one, both take their weighted
    mean, so more rows never take less time. The running maximum it replaced let one slow moment at a row count
    seen a few times raise every larger count up to it: SmolLM2 float32 at batch 1 learnt 20.0 ms for 5-11 rows
    (measured alone: 13.9-17.3) and cut most drafts to 2-3 tokens."""
    blocks: list[list[float]] = []  # [weight, mean, points pooled]
    for _, (seconds, weight) in points:
        blocks.append([weight, seconds, 1])
        while len(blocks) > 1 and blocks[-2][1] > blocks[-1][1]:
            w2, m2, n2 = blocks.pop()
            w1, m1, n1 = blocks[-1]
            blocks[-1] = [w1 + w2, (w1 * m1 + w2 * m2) / (w1 + w2), n1 + n2]
    means = [m for _, m, n in blocks for _ in range(int(n))]
    return [(r, m) for (r, _), m in zip(points, means)]


class StepCost:
    def __init__(self, prior: dict[int, float] | None = None, margin: float = TRIM_MARGIN) -> None:
        """``prior``: rows -> seconds timed at load (engine/spec/prior.py). It gives the curve's shape where no
        step was seen; its level follows the steps seen (a timed forward lacks the sampling and bookkeeping of
        a real step, so where both exist their mean difference is added to the prior's other row counts).
        ``margin``: the least expected gain in tokens per second for which ``trim`` keeps any draft."""
        self._prior = dict(prior or {})
        self._mean: dict[int, float] = {}  # rows -> weighted mean seconds
        self._weight: dict[int, float] = {}  # rows -> weight of that mean (decayed as other steps arrive)
        self._table: list[tuple[int, float]] | None = None  # sorted (rows, non-decreasing seconds), rebuilt lazily
        self._margin = margin

    def observe(self, rows: int, seconds: float) -> None:
        guess = self.estimate(rows)
        if guess is not None and guess > 0:
            seconds = min(seconds, OUTLIER * guess)
        least = min(self._weight, default=rows)
        for r in list(self._weight):
            self._weight[r] *= DECAY
            # not seen for ~350 steps: the load it saw is gone (but the fewest rows, plain decoding's step, are
            # kept: steps that all draft never measure it again)
            if self._weight[r] < FORGET and r != rows and r != least:
                del self._weight[r], self._mean[r]
        w = self._weight.get(rows, 0.0)
        self._mean[rows] = (self._mean.get(rows, 0.0) * w + seconds) / (w + 1)
        self._weight[rows] = w + 1
        self._table = None

    def _points(self) -> list[tuple[int, float]]:
        if self._table is None:
            both = [self._mean[r] - t for r, t in self._prior.items() if r in self._mean]
            offset = sum(both) / len(both) if both else 0.0
            points = {r: (t + offset, PRIOR_WEIGHT) for r, t in self._prior.items()}
            points |= {r: (m, self._weight[r]) for r, m in self._mean.items()}
            self._table = monotone(sorted(points.items()))
        return self._table

    def estimate(self, rows: int) -> float | None:
        """Seconds for a step of ``rows`` rows, or None before any step was seen."""
        points = self._points()
        if not points:
            return None
        i = bisect.bisect_left(points, (rows, -1.0))
        if i < len(points) and points[i][0] == rows:
            return points[i][1]
        if i == 0:
            return points[0][1]  # fewer rows than any step seen: no less than nothing, no more than the least
        if i == len(points):
            if len(points) == 1:
                return points[0][1]  # one row count seen: the slope is unknown, taken as zero
            (r0, t0), (r1, t1) = points[-2], points[-1]
            return t1 + (t1 - t0) / (r1 - r0) * (rows - r1)
        (r0, t0), (r1, t1) = points[i - 1], points[i]
        return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)

    def trim(self, decodes: int, drafts: list[list[float]]) -> list[int]:
        """How many nodes of each of ``drafts`` to verify alongside ``decodes`` decoding requests. A draft is given
        as its nodes' expected acceptance, in the order they are to be kept (non-increasing: a chain's i-th token
        is accepted with probability rate^i, ``chain_values``; a tree orders its nodes so, engine/spec/tree.py),
        so the nodes of all drafts are taken by that value (each draft's in its own order, a prefix of it) and
        the most that maximise expected tokens per second: (decodes + expected accepted) / time(rows); of counts
        that tie, the most (more positions at the same throughput end each drafted request in fewer steps). An
        earlier choice also kept counts within 1% of the best: per position, that let a row through wherever rows
        cost a decode each."""
        base = self.estimate(decodes)
        if base is None or base <= 0:
            return [len(values) for values in drafts]
        positions = sorted(((v, j) for j, values in enumerate(drafts) for v in values),
                           key=lambda p: -p[0])  # stable: equal values keep each draft's own order
        rates, tokens = [decodes / base], float(decodes)
        for count, (value, _) in enumerate(positions, 1):
            tokens += value
            cost = self.estimate(decodes + count) or 0.0
            rates.append(tokens / cost if cost > 0 else float("inf"))
        best = max(rates)
        if best < rates[0] * (1 + self._margin) and len(self._points()) > 1:  # too close to call: plain decoding
            # (with one row count seen, more rows are taken as free, so drafting explores their cost)
            return [0] * len(drafts)
        keep = max(i for i, r in enumerate(rates) if r >= best * (1 - TIE))
        lengths = [0] * len(drafts)
        for _, j in positions[:keep]:
            lengths[j] += 1
        return lengths
