"""The radix prefix cache's records (only the cache that holds them changes their fields: engine/mem/
radix_cache.py, and hiradix_cache.py for its lower tiers): a node, one edge of whole pages and where their KV
lives in each tier; and a load in flight, the lower-tier pages being copied into L1 pages that belong to it
until the tree takes them."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

PageKey = tuple[int, ...]
STORED = -1  # ``TreeNode.stored`` of a node read from the store: no write needed


class TreeNode:
    __slots__ = ("children", "parent", "key", "pages", "host", "stored", "lock_ref", "host_ref", "last_access",
                 "hits", "priority", "loading")

    def __init__(self, key: PageKey, pages: list[int], parent: TreeNode | None) -> None:
        self.children: dict[PageKey, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.pages = pages  # L1 pages; empty when the node lives in L2 only
        self.host: list[int] | None = None  # L2 pages
        self.stored = 0  # its write to the shared store (L3): the writer's id, STORED if read from it, 0 if none
        self.lock_ref = 0
        self.host_ref = 0
        self.last_access = 0
        self.hits = 0
        self.priority = 0
        self.loading: LoadTicket | None = None  # its L2 pages are being copied into L1 pages

    def __lt__(self, other: TreeNode) -> bool:  # heap tie-break; ordering is by the policy tuple first
        return id(self) < id(other)


@dataclass(eq=False)
class LoadTicket:
    """A load-back in flight: ``parts`` are L2-only nodes under ``parent`` (locked meanwhile), each with the
    fresh L1 pages its L2 pages are copied into; ``stored_pages`` receive the store's entries for the tokens
    after the last of them (``stored_at``). The pages are the ticket's until the tree takes them."""

    parent: TreeNode
    parts: list[tuple[TreeNode, list[int]]]
    stored_at: TreeNode
    stored_keys: tuple[str, ...] = ()
    stored_tokens: tuple[int, ...] = ()
    stored_pages: list[int] = field(default_factory=list)
    future: Future[Any] | None = None

    def split(self, lower: TreeNode, upper: TreeNode, cut: int) -> None:
        """``lower``'s first ``cut`` pages became the new node ``upper`` above it."""
        i = next(k for k, (n, _) in enumerate(self.parts) if n is lower)
        pages = self.parts[i][1]
        self.parts[i:i + 1] = [(upper, pages[:cut]), (lower, pages[cut:])]

    def pages(self) -> list[int]:
        return [p for _, pages in self.parts for p in pages] + self.stored_pages
