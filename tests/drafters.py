"""Drafters for speculative-decoding tests, at the two ends of acceptance: an oracle that proposes the target's
own continuation (recorded from a run without speculation: every draft is accepted) and an adversary that proposes
seeded random tokens (almost every draft is rejected)."""
from __future__ import annotations

import random
from dataclasses import replace

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.spec import Drafter, DraftTree


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


class TreeDrafter(Drafter):
    """Proposes a token tree per request in which the target's own continuation (``truth``, as the oracle's) is
    never the first branch: a random branch comes first and weighs most, the oracle's path follows, and a third
    branch shares the oracle's first tokens and then parts from it (so the accepted path's K/V always has to move,
    and rows attend over paths that leave the storage order)."""

    name = "tree"

    def __init__(self, truth: dict[str, list[int]], vocab: int, seed: int = 0) -> None:
        self.truth = truth
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int] | DraftTree]:
        out: list[list[int] | DraftTree] = []
        for req, k in zip(reqs, limits):
            done = len(req.output_ids)
            good = list(self.truth.get(req.rid, [])[done:done + k])
            noise = [self.rng.randrange(self.vocab) for _ in range(k)]
            tokens, parents, weights = list(noise), list(range(-1, k - 1)), [0.9] * k
            at = -1
            for i, t in enumerate(good):  # the oracle's path
                tokens.append(t)
                parents.append(at)
                weights.append(0.5)
                at = len(tokens) - 1
                if i == len(good) // 2 and i + 1 < len(good):  # a sibling of the oracle's next token
                    tokens.append((good[i + 1] + 1) % self.vocab)
                    parents.append(at)
                    weights.append(0.4)
            out.append(DraftTree(tuple(tokens), tuple(parents), tuple(weights)))
        return out


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
