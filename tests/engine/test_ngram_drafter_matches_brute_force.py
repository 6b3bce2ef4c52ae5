"""The n-gram drafter's incremental index proposes exactly what a brute-force search proposes: the tokens after
the latest earlier occurrence of the longest matching suffix (n from max down to min), tagged with that n as its
evidence, on seeded random sequences over a small alphabet (many matches) grown a few tokens at a time, as decoding
grows them."""
from __future__ import annotations

import random

import pytest

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec import DraftTree, NgramDrafter
from engine.spec.tree import path


def brute_force(seq: list[int], min_n: int, max_n: int, limit: int) -> tuple[list[int], int]:
    """The continuation and the suffix length it matched (([], 0): none)."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(seq):
            continue
        suffix = seq[-n:]
        for end in range(len(seq) - 1, n - 1, -1):  # latest first; the suffix itself (end = len) excluded
            if seq[end - n:end] == suffix:
                return seq[end:end + limit], n
    return [], 0


def tokens(draft: list[int] | DraftTree) -> list[int]:
    return list(draft.tokens) if isinstance(draft, DraftTree) else draft


@pytest.mark.parametrize("seed", range(6))
def test_proposals_equal_a_brute_force_search(seed: int) -> None:
    rng = random.Random(seed)
    min_n, max_n = rng.choice([(1, 3), (2, 4), (3, 3), (1, 1)])
    alphabet = rng.choice([2, 3, 6])
    drafter = NgramDrafter(min_n, max_n)
    req = Request("r", [rng.randrange(alphabet) for _ in range(rng.randrange(1, 40))], SamplingParams(), 10_000)
    proposals = 0
    for _ in range(80):
        limit = rng.randrange(1, 7)
        (got,) = drafter.propose([req], [limit])
        seq = req.prompt_ids + req.output_ids
        want, n = brute_force(seq, min_n, max_n, limit)
        assert tokens(got) == want, f"at length {len(seq)}"
        if want:
            assert isinstance(got, DraftTree) and got.is_chain and got.evidence == n
        proposals += bool(want)
        req.output_ids.extend(rng.randrange(alphabet) for _ in range(rng.randrange(1, 4)))
    assert proposals >= 10, "the sequences were meant to repeat"


def test_a_copied_passage_is_proposed_whole() -> None:
    passage = list(range(100, 140))
    req = Request("r", [7, 8] + passage + [9], SamplingParams(), 100)
    req.output_ids = passage[:3]
    (got,) = NgramDrafter(2, 4).propose([req], [8])
    assert tokens(got) == passage[3:11] and got.evidence == 3
    req.output_ids = [1, 2, 3]
    assert NgramDrafter(2, 4).propose([req], [8]) == [[]]


def brute_force_branches(seq: list[int], min_n: int, max_n: int, limit: int,
                         branches: int) -> list[tuple[list[int], int]]:
    """Up to ``branches`` continuations: latest occurrences of the longest suffix first (4 per branch looked at
    for each n), skipping one that is a prefix of a continuation found before; with the n each matched."""
    found: list[tuple[list[int], int]] = []
    for n in range(max_n, min_n - 1, -1):
        if n >= len(seq):
            continue
        seen = 0
        for end in range(len(seq) - 1, n - 1, -1):
            if len(found) >= branches or seen >= 4 * branches:
                break
            if seq[end - n:end] == seq[-n:]:
                seen += 1
                run = seq[end:end + limit]
                if not any(c[:len(run)] == run for c, _ in found):
                    found.append((run, n))
        if len(found) >= branches:
            break
    return found


@pytest.mark.parametrize("seed", range(6))
def test_tree_proposals_hold_the_brute_force_continuations(seed: int) -> None:
    """With branches, every continuation the brute force finds is a root-to-node path of the tree, the tree holds
    nothing else, and a node's weight is the matched-suffix-length share of the continuations through it."""
    rng = random.Random(100 + seed)
    min_n, max_n = rng.choice([(1, 3), (2, 4), (1, 1)])
    branches = rng.choice([2, 3, 5])
    drafter = NgramDrafter(min_n, max_n, branches)
    req = Request("r", [rng.randrange(4) for _ in range(rng.randrange(1, 40))], SamplingParams(), 10_000)
    trees = 0
    for _ in range(60):
        limit = rng.randrange(1, 6)
        (got,) = drafter.propose([req], [limit])
        want = brute_force_branches(req.prompt_ids + req.output_ids, min_n, max_n, limit, branches)
        if not want:
            assert got == []
        else:
            assert isinstance(got, DraftTree)
            paths = {tuple(got.tokens[j] for j in path(got.parents, i)): got.weights[i] for i in range(len(got))}
            prefixes = {tuple(run[:d]) for run, _ in want for d in range(1, len(run) + 1)}
            assert set(paths) == prefixes
            total = sum(n for _, n in want)
            assert got.evidence == max(n for _, n in want)
            for prefix, weight in paths.items():
                share = sum(n for run, n in want if tuple(run[:len(prefix)]) == prefix) / total
                assert weight == pytest.approx(share)
            trees += len(want) > 1
        req.output_ids.extend(rng.randrange(4) for _ in range(rng.randrange(1, 4)))
    assert trees >= 10, "the sequences were meant to branch"
