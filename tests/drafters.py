"""Drafters for speculative-decoding tests, at the two ends of acceptance: an oracle that proposes the target's
own continuation (recorded from a run without speculation: every draft is accepted) and an adversary that proposes
seeded random tokens (almost every draft is rejected)."""
from __future__ import annotations

import random
from dataclasses import replace

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.spec import Drafter


class OracleDrafter(Drafter):
    """Proposes ``truth[rid]`` from the request's current output length on (the reference run's output)."""

    name = "oracle"

    def __init__(self, truth: dict[str, list[int]]) -> None:
        self.truth = truth

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, limits):
            done = len(req.output_ids)
            out.append(list(self.truth.get(req.rid, [])[done:done + k]))
        return out


class RandomDrafter(Drafter):
    """Proposes ``limit`` random token ids below ``vocab``, from a seeded generator."""

    name = "random"

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(k)] for k in limits]


class CountingForwards:
    """Counts the target model's forward passes (instrumentation around the engine's real runner)."""

    def __init__(self, core) -> None:  # noqa: ANN001 - an EngineCore
        self.count = 0
        forward = core.runner.forward

        def wrapped(batch):  # noqa: ANN001, ANN202
            self.count += 1
            return forward(batch)
        core.runner.forward = wrapped


def drafting_always(spec: SpeculativeConfig) -> SpeculativeConfig:
    """``spec`` with the speculator's cost decisions (whether a step drafts, how many drafts it keeps) turned off:
    they follow measured step times, which tests must not depend on. Acceptance-based pauses stay."""
    return replace(spec, speculative_policy="acceptance")
