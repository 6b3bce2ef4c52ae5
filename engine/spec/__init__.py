"""Speculative decoding: drafters (engine/spec/base.py: n-gram lookup, a draft model), verification (verify.py)
and the per-step glue with its adaptive policy (speculator.py)."""
from __future__ import annotations

import torch

from engine.config import EngineConfigError, ModelConfig, SpeculativeConfig
from engine.spec.base import Drafter
from engine.spec.ngram import NgramDrafter
from engine.spec.prior import CostPrior
from engine.spec.prior import measure as measure_prior
from engine.spec.speculator import Speculator
from engine.spec.tree import DraftTree
from engine.spec.verify import DraftRow, accepted, draft_rows, split_rows
from engine.tokenizer import Tokenizer

__all__ = ["CostPrior", "DraftRow", "DraftTree", "Drafter", "NgramDrafter", "Speculator", "accepted", "create_drafter",
           "draft_rows", "measure_prior", "split_rows"]


def create_drafter(cfg: SpeculativeConfig, target: ModelConfig, tokenizer: Tokenizer, vocab_size: int,
                   dtype: torch.dtype, device: torch.device) -> Drafter | None:
    """The configured drafter (a draft model is loaded here, its pool comes later), or None."""
    cfg.check()
    if cfg.speculative_algorithm == "none":
        return None
    if cfg.speculative_algorithm == "ngram":
        return NgramDrafter(cfg.speculative_ngram_min, cfg.speculative_ngram_max, cfg.speculative_ngram_branches)
    if cfg.speculative_algorithm == "draft_model":
        from engine.spec.draft_model import load_draft_model
        return load_draft_model(cfg, target, tokenizer, vocab_size, dtype, device)
    raise EngineConfigError(f"--speculative-algorithm {cfg.speculative_algorithm!r} is unknown")
