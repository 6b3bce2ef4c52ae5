"""N-gram drafting (prompt lookup): the draft is what followed the most recent earlier occurrence of the
sequence's last n tokens, n from ``max_n`` down to ``min_n`` (a longer match predicts better). Copy-heavy output
(quoting a document, editing code, repeating a list) continues what is already in the context, so its drafts are
often accepted whole; output with nothing to copy rarely matches and gets no draft.

With ``branches`` above 1 the draft is a token tree (engine/spec/tree.py) of up to that many continuations: the
latest occurrences of the longest matching suffix first, then of shorter ones, each continuation a branch where it
parts from the ones before. A node's weight is the share of the continuations, each counted by the length of the
suffix it matched, that pass through it: where earlier occurrences disagree, each branch is as likely as the
context says, and the speculator verifies the nodes worth their rows (engine/spec/cost.py). A draft carries the
longest suffix length it matched as its evidence: a draft after a 3- or 4-token match is accepted about twice as
often as one after a single token, and the speculator learns by how much.

Per request an index maps each n-gram (packed exactly into one int) to the position after its latest occurrence;
it is built once over the prompt and extended by the new tokens each step, so a step costs O(new tokens), not
O(sequence length)."""
from __future__ import annotations

import weakref

from engine.request import Request
from engine.spec.base import Drafter
from engine.spec.tree import DraftTree

_BITS = 32  # token ids are below 2**32, so an n-gram packs exactly


class _Index:
    __slots__ = ("by_n", "before", "indexed")

    def __init__(self, sizes: range) -> None:
        self.by_n: dict[int, dict[int, int]] = {n: {} for n in sizes}
        # per n: the end of an occurrence -> the end of the same n-gram's occurrence before it
        self.before: dict[int, dict[int, int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending at or before this position are in by_n


def _pack(tokens: list[int]) -> int:
    key = 0
    for t in tokens:
        key = (key << _BITS) | t
    return key


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, min_n: int, max_n: int, branches: int = 1) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self.branches = branches
        self._index: weakref.WeakKeyDictionary[Request, _Index] = weakref.WeakKeyDictionary()

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int] | DraftTree]:
        return [self._propose(r, k) if k > 0 else [] for r, k in zip(reqs, limits)]

    def _propose(self, req: Request, limit: int) -> list[int] | DraftTree:
        index = self._index.get(req)
        if index is None:
            index = self._index[req] = _Index(self.sizes)
        length = req.seq_len
        self._extend(req, index, length - 1)  # every n-gram but the suffix itself
        found: list[tuple[list[int], int]] = []  # continuations and the suffix length each matched
        for n in self.sizes:
            if n >= length:
                continue
            at = index.by_n[n].get(_pack(req.tokens(length - n, length)))
            if at is not None and self.branches == 1:
                return DraftTree.chain(req.tokens(at, min(at + limit, length)), n)
            seen = 0
            while at is not None and len(found) < self.branches and seen < 4 * self.branches:
                seen += 1
                run = req.tokens(at, min(at + limit, length))
                if not any(c[:len(run)] == run for c, _ in found):  # a prefix of one found adds nothing
                    found.append((run, n))
                at = index.before[n].get(at)
            if len(found) >= self.branches:
                break
        return _tree(found) if found else []

    @staticmethod
    def _extend(req: Request, index: _Index, end: int) -> None:
        """Index the n-grams that end at positions index.indexed + 1 ... end (exclusive ends)."""
        if end <= index.indexed:
            return
        widest = max(index.by_n)
        start = max(0, index.indexed - widest)
        window = req.tokens(start, end)
        for n, table in index.by_n.items():
            before = index.before[n]
            for stop in range(max(index.indexed + 1, n), end + 1):
                key = _pack(window[stop - n - start:stop - start])
                last = table.get(key)
                if last is not None:
                    before[stop] = last
                table[key] = stop
        index.indexed = end

    def release(self, req: Request) -> None:
        self._index.pop(req, None)


def _tree(found: list[tuple[list[int], int]]) -> DraftTree:
    """The token tree of the continuations found, each weighted by the suffix length it matched."""
    tokens: list[int] = []
    parents: list[int] = []
    support: list[float] = []
    children: dict[tuple[int, int], int] = {}
    for run, n in found:
        at = -1
        for t in run:
            node = children.get((at, t))
            if node is None:
                node = children[(at, t)] = len(tokens)
                tokens.append(t)
                parents.append(at)
                support.append(0.0)
            support[node] += n
            at = node
    total = sum(n for _, n in found)
    return DraftTree(tuple(tokens), tuple(parents), tuple(w / total for w in support), max(n for _, n in found))
