"""A step's token bitmask for its constrained rows, filled on a helper thread while the forward pass runs, and
applied to the logits once both are done. Filling costs ~2-200 us per row depending on the grammar state (xgrammar
caches the masks of context-free positions at compile time); the forward pass of a step takes tens of
milliseconds, so the fill is hidden behind it. A row whose fill fails is reported for that row alone."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
import torch

from engine.grammar.state import GrammarState


class StepMask:
    """Which logits rows are constrained and their filled bitmask (``errors``: rows whose fill failed)."""

    def __init__(self, rows: list[int], bitmask: torch.Tensor, errors: dict[int, Exception], seconds: float) -> None:
        self.rows = rows
        self.bitmask = bitmask
        self.errors = errors
        self.seconds = seconds  # how long the fill took (on its own thread, beside the forward pass)

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits become -inf, in place, on the constrained rows that filled."""
        import xgrammar as xgr
        rows = [r for r in self.rows if r not in self.errors]
        if rows:
            xgr.apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=logits.shape[-1], indices=rows)


class MaskFiller:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def start(self, states: list[GrammarState | None]) -> Future[StepMask] | None:
        """Begin filling the masks of a step whose logits rows belong to ``states`` (None: unconstrained)."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        return self._pool.submit(self._fill, states, rows)

    def _fill(self, states: list[GrammarState | None], rows: list[int]) -> StepMask:
        import xgrammar as xgr
        start = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        errors: dict[int, Exception] = {}
        for row in rows:
            try:
                states[row].fill(bitmask, row)  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - this request's grammar, not the step's
                errors[row] = e
        return StepMask(rows, bitmask, errors, time.perf_counter() - start)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

