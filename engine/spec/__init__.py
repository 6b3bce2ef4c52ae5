"""Speculative decoding: drafters (engine/spec/base.py), verification (verify.py) and the per-step glue with its
adaptive policy (speculator.py)."""
from engine.config import EngineConfigError, SpeculativeConfig
from engine.spec.base import Drafter
from engine.spec.ngram import NgramDrafter
from engine.spec.speculator import Speculator
from engine.spec.verify import DraftRow, accepted, draft_rows, split_rows

__all__ = ["DraftRow", "Drafter", "NgramDrafter", "Speculator", "accepted", "create_speculator", "draft_rows",
           "split_rows"]


def create_speculator(cfg: SpeculativeConfig, vocab_size: int, drafter: Drafter | None = None) -> Speculator | None:
    """The configured speculator, or None; ``drafter`` (tests, offline use) replaces the configured one."""
    cfg.check()
    if drafter is not None:
        return Speculator(cfg, drafter, vocab_size)
    if not cfg.enabled:
        return None
    if cfg.speculative_algorithm == "ngram":
        return Speculator(cfg, NgramDrafter(cfg.speculative_ngram_min, cfg.speculative_ngram_max), vocab_size)
    raise EngineConfigError(f"--speculative-algorithm {cfg.speculative_algorithm!r} is unknown")
