"""When drafts pay: a verification adds rows to the step, and a step's time grows with its rows. While the step
is bound by reading the weights (few rows), extra rows are almost free; once it is bound by arithmetic (many
rows, on a CPU already at a batch of tens), every row costs about as much as a decoding request, and drafts that
are not nearly all accepted make the step slower per token than plain decoding.

``StepCost`` learns the step time as a line in the row count, a + b * rows, fitted by least squares over the
engine's own recent decode steps (exponentially weighted, so it follows the batch sizes and the load of the
moment), so no per-machine constant is assumed. ``choose`` takes the drafted requests in order of their
acceptance and keeps the prefix of them that maximises expected tokens per second: (decodes + expected accepted
drafts) / time(rows). Until the steps seen differ in rows the slope is unknown and taken as zero (so drafting
starts by exploring); the speculator also keeps every draft on one step in ``PROBE_EVERY``, so the cost of
extra rows keeps being measured."""
from __future__ import annotations

DECAY = 0.98  # weight kept by the older steps at each new one (a memory of ~50 decode steps)
TIE = 0.01  # expected tokens per second this close to the best count as as good


def expected_accepted(rate: float, drafted: int) -> float:
    """Expected accepted drafts of ``drafted`` when each is accepted with probability ``rate`` (given the ones
    before it were): rate + rate^2 + ... + rate^drafted."""
    return sum(rate ** i for i in range(1, drafted + 1))


class StepCost:
    def __init__(self) -> None:
        self._sums = [0.0] * 5  # weighted sums of 1, rows, rows^2, seconds, rows * seconds

    def observe(self, rows: int, seconds: float) -> None:
        w, r, rr, t, rt = self._sums
        d = DECAY
        self._sums = [d * w + 1, d * r + rows, d * rr + rows * rows, d * t + seconds, d * rt + rows * seconds]

    def estimate(self, rows: int) -> float | None:
        """Seconds for a step of ``rows`` rows, or None before any step was seen."""
        w, r, rr, t, rt = self._sums
        if w == 0:
            return None
        spread = w * rr - r * r
        slope = max(0.0, (w * rt - r * t) / spread) if spread > 1e-9 * w * w else 0.0
        return max(0.0, (t - slope * r) / w) + slope * rows

    def choose(self, decodes: int, drafts: list[tuple[float, int]]) -> int:
        """How many of ``drafts`` ((acceptance rate, draft length), best rate first) to verify alongside
        ``decodes`` decoding requests: the most whose expected tokens per second is within ``TIE`` of the best
        choice's (more drafts at the same throughput still end each drafted request in fewer steps)."""
        base = self.estimate(decodes)
        if base is None or base <= 0:
            return len(drafts)
        rates = [decodes / base]
        tokens, rows = float(decodes), decodes
        for rate, length in drafts:
            tokens += expected_accepted(rate, length)
            rows += length
            cost = self.estimate(rows) or 0.0
            rates.append(tokens / cost if cost > 0 else float("inf"))
        best = max(rates)
        return max(i for i, r in enumerate(rates) if r >= best * (1 - TIE))
