"""A step's token bitmask for its constrained rows, filled on a helper thread while the forward pass runs, and
applied to the logits once both are done (as one bool per token, unpacked on the helper thread too). Filling
costs ~2-200 us per row depending on the grammar state (xgrammar caches the masks of context-free positions at
compile time); the forward pass of a step takes tens of milliseconds, so the fill is hidden behind it. A row whose fill fails is reported for that row alone."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.grammar.state import GrammarState


_SHIFTS = torch.arange(32, dtype=torch.int32)


class StepMask:
    """Which logits rows are constrained, their filled bitmask (``errors``: rows whose fill failed), and the
    bitmask unpacked to one bool per token for the rows that filled (``allowed``), also done beside the forward
    pass: unpacking 64 rows of a 49k vocabulary takes ~4 ms, xgrammar's CPU apply kernel ~13 ms."""

    def __init__(self, rows: list[int], allowed: torch.Tensor, errors: dict[int, Exception], seconds: float) -> None:
        self.rows = rows
        self.filled = [r for r in rows if r not in errors]
        self.allowed = allowed  # [len(filled), vocab] bool
        self.errors = errors
        self.seconds = seconds  # how long fill and unpack took (on their own thread, beside the forward pass)

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed tokens' logits become -inf, in place, on the constrained rows that filled."""
        if not self.filled:
            return
        banned = ~self.allowed.to(logits.device, non_blocking=True)
        if len(self.filled) == logits.shape[0]:
            logits.masked_fill_(banned, float("-inf"))
        else:
            idx = torch.tensor(self.filled, dtype=torch.long, device=logits.device)
            logits[idx] = logits[idx].masked_fill(banned, float("-inf"))


class MaskFiller:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def start(self, states: list[GrammarState | None],
              ahead: list[tuple[int, ...]] | None = None) -> Future[StepMask] | None:
        """Begin filling the masks of a step whose logits rows belong to ``states`` (None: unconstrained).
        ``ahead[i]``: tokens row i comes after that the state has not accepted (a speculative verification's
        drafts: a chain's rows each one token further than the one before, a tree's each its node's path; the
        state steps back to where two rows' paths part); the state is put back once its rows are filled."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        return self._pool.submit(self._fill, states, rows, ahead or [()] * len(states))

    def _fill(self, states: list[GrammarState | None], rows: list[int], ahead: list[tuple[int, ...]]) -> StepMask:
        import xgrammar as xgr
        start = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        errors: dict[int, Exception] = {}
        advanced: dict[int, tuple[GrammarState, tuple[int, ...]]] = {}  # id(state) -> (state, drafts it holds)
        for row in rows:
            state = states[row]
            try:
                _, held = advanced.get(id(state), (state, ()))
                want = ahead[row]
                common = next((i for i, (a, b) in enumerate(zip(held, want)) if a != b), min(len(held), len(want)))
                if common < len(held):  # a tree's other branch: back to where the two paths part
                    state.rollback(len(held) - common)  # type: ignore[union-attr]
                    held = held[:common]
                    advanced[id(state)] = (state, held)  # type: ignore[assignment]
                for token in want[common:]:
                    state.accept(token)  # type: ignore[union-attr]
                    held = (*held, token)
                    advanced[id(state)] = (state, held)  # type: ignore[assignment]
                state.fill(bitmask, row)  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001 - this request's grammar, not the step's
                errors[row] = e
        for state, held in advanced.values():
            if held:
                state.rollback(len(held))
        words = bitmask[[r for r in rows if r not in errors]]
        allowed = ((words.unsqueeze(-1) >> _SHIFTS) & 1).bool().reshape(words.shape[0], 32 * words.shape[1])
        allowed = allowed[:, :self.vocab_size]
        return StepMask(rows, allowed, errors, time.perf_counter() - start)

