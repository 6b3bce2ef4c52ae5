"""Draft token trees. A draft is a tree of proposed tokens rooted at the request's newest token: node i holds
``tokens[i]`` and follows node ``parents[i]`` (-1: the root), parents before children. A chain, one token per
position, is the tree whose node i follows node i - 1; every helper takes ``parents=()`` to mean that chain.

Where a tree lives in the step (engine/runner/model_runner.py): node i's K/V is written to the request's position
``start + 1 + i`` (its storage slot), while its rotary position is ``start + depth(i)``, and it attends over the
request's tokens up to the root plus its own path (its ancestors and itself), which for a chain is exactly the
positions before it. Verification (engine/spec/verify.py) walks from the root, each step to the child holding the
token the target sampled; the accepted path's K/V then moves to the positions a chain would have put it at
(``moves``), so what follows never sees the tree."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftTree:
    """A drafter's proposal for one request: tokens, their parents, and each node's weight, the drafter's own
    estimate of the chance its path is right given that the paths of the other candidates exist (1.0 along a
    chain; siblings' weights share their parent's)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    weights: tuple[float, ...]
    evidence: int = 0  # the drafter's class of this proposal, acceptance learnt per class (ngram: suffix matched)

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.parents) == len(self.weights), "one parent and weight per node"
        assert all(-1 <= p < i for i, p in enumerate(self.parents)), "parents come before their children"

    @staticmethod
    def chain(tokens: list[int] | tuple[int, ...], evidence: int = 0) -> DraftTree:
        n = len(tokens)
        return DraftTree(tuple(tokens), tuple(range(-1, n - 1)), (1.0,) * n, evidence)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return is_chain(self.parents)

    def keep(self, nodes: list[int]) -> DraftTree:
        """The subtree of ``nodes`` (each one's parent among them, or the root), renumbered in the given order
        (which must put parents first)."""
        at = {old: new for new, old in enumerate(nodes)}
        parents = tuple(-1 if self.parents[i] < 0 else at[self.parents[i]] for i in nodes)
        return DraftTree(tuple(self.tokens[i] for i in nodes), parents, tuple(self.weights[i] for i in nodes),
                         self.evidence)

    def prefix(self, n: int) -> DraftTree:
        """Its first ``n`` nodes (a subtree, since parents come first)."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.weights[:n], self.evidence)


def is_chain(parents: tuple[int, ...]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def depths(parents: tuple[int, ...], n: int) -> list[int]:
    """Depth of each of ``n`` nodes (the root's children are at depth 1)."""
    if not parents:
        return list(range(1, n + 1))
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path(parents: tuple[int, ...], node: int) -> list[int]:
    """The nodes from depth 1 down to ``node`` (inclusive)."""
    if not parents:
        return list(range(node + 1))
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def walk(tokens: tuple[int, ...], parents: tuple[int, ...], sampled: list[int]) -> tuple[list[int], list[int]]:
    """Verification's walk: ``sampled[0]`` is the target's token after the root, ``sampled[1 + i]`` its token after
    node i. From the root, while a child holds the token sampled at the current node, move to it. Returns the
    tokens emitted (the sampled token at each node of the accepted path and at its end) and the accepted nodes."""
    assert len(sampled) == len(tokens) + 1, "one sampled token per verified position"
    children: dict[int, dict[int, int]] = {}
    for i in range(len(tokens)):
        children.setdefault(parents[i] if parents else i - 1, {}).setdefault(tokens[i], i)
    emitted, nodes, at = [sampled[0]], [], -1
    while True:
        nxt = children.get(at, {}).get(emitted[-1])
        if nxt is None:
            return emitted, nodes
        nodes.append(nxt)
        at = nxt
        emitted.append(sampled[1 + nxt])


def moves(nodes: list[int]) -> list[tuple[int, int]]:
    """(from, to) offsets after the root, for the accepted ``nodes``: node i's K/V sits at offset 1 + i and belongs
    at 1 + its depth - 1 = 1 + j for the j-th accepted node. In increasing order of j a copy never overwrites a
    later source (a node's index is at least its depth - 1)."""
    return [(1 + i, 1 + j) for j, i in enumerate(nodes) if i != j]
