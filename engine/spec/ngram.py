"""N-gram drafting (prompt lookup): the draft is what followed the most recent earlier occurrence of the
sequence's last n tokens, n from ``max_n`` down to ``min_n`` (a longer match predicts better). Copy-heavy output
(quoting a document, editing code, repeating a list) continues what is already in the context, so its drafts are
often accepted whole; output with nothing to copy rarely matches and gets no draft.

Per request an index maps each n-gram (packed exactly into one int) to the position after its latest occurrence;
it is built once over the prompt and extended by the new tokens each step, so a step costs O(new tokens), not
O(sequence length)."""
from __future__ import annotations

import weakref

from engine.request import Request
from engine.spec.base import Drafter

_BITS = 32  # token ids are below 2**32, so an n-gram packs exactly


class _Index:
    __slots__ = ("by_n", "indexed")

    def __init__(self, sizes: range) -> None:
        self.by_n: dict[int, dict[int, int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending at or before this position are in by_n


def _pack(tokens: list[int]) -> int:
    key = 0
    for t in tokens:
        key = (key << _BITS) | t
    return key


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self._index: weakref.WeakKeyDictionary[Request, _Index] = weakref.WeakKeyDictionary()

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        return [self._propose(r, k) if k > 0 else [] for r, k in zip(reqs, limits)]

    def _propose(self, req: Request, limit: int) -> list[int]:
        index = self._index.get(req)
        if index is None:
            index = self._index[req] = _Index(self.sizes)
        length = req.seq_len
        self._extend(req, index, length - 1)  # every n-gram but the suffix itself
        for n in self.sizes:
            if n >= length:
                continue
            at = index.by_n[n].get(_pack(req.tokens(length - n, length)))
            if at is not None:
                return req.tokens(at, min(at + limit, length))
        return []

    @staticmethod
    def _extend(req: Request, index: _Index, end: int) -> None:
        """Index the n-grams that end at positions index.indexed + 1 ... end (exclusive ends)."""
        if end <= index.indexed:
            return
        widest = max(index.by_n)
        start = max(0, index.indexed - widest)
        window = req.tokens(start, end)
        for n, table in index.by_n.items():
            for stop in range(max(index.indexed + 1, n), end + 1):
                table[_pack(window[stop - n - start:stop - start])] = stop
        index.indexed = end

    def release(self, req: Request) -> None:
        self._index.pop(req, None)
