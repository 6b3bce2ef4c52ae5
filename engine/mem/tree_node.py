"""A node of the radix prefix cache (engine/mem/radix_cache.py, which alone changes its fields): one edge of
whole pages and where their KV lives in each tier."""
from __future__ import annotations

PageKey = tuple[int, ...]


class TreeNode:
    __slots__ = ("children", "parent", "key", "pages", "host", "stored", "lock_ref", "host_ref", "last_access",
                 "hits", "priority")

    def __init__(self, key: PageKey, pages: list[int], parent: TreeNode | None) -> None:
        self.children: dict[PageKey, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.pages = pages  # L1 pages; empty when the node lives in L2 only
        self.host: list[int] | None = None  # L2 pages
        self.stored = False  # written to the shared store (L3)
        self.lock_ref = 0
        self.host_ref = 0
        self.last_access = 0
        self.hits = 0
        self.priority = 0

    def __lt__(self, other: TreeNode) -> bool:  # heap tie-break; ordering is by the policy tuple first
        return id(self) < id(other)
