"""RadixAttention's prefix cache: a radix tree over token ids whose edges are whole pages.

- Matching is page-aligned; a match that ends inside a node splits it (pages are re-sliced, never copied).
- ``lock_ref`` on a node protects it and its ancestors; locked tokens count as ``protected_size``, the rest as
  ``evictable_size``.
- Eviction frees unlocked leaves, ordered by the policy: lru (oldest access), lfu (fewest hits, then oldest)
  or priority (lowest request priority, then oldest).
- ``extra_key`` namespaces: each key has its own root, so different namespaces never share pages.
Access times are a logical clock, so behaviour is deterministic."""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from engine.config import EngineConfigError
from engine.mem.base import MatchResult, PrefixCache

PageKey = tuple[int, ...]


class TreeNode:
    __slots__ = ("children", "parent", "key", "pages", "lock_ref", "last_access", "hits", "priority")

    def __init__(self, key: PageKey, pages: list[int], parent: TreeNode | None) -> None:
        self.children: dict[PageKey, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = 0
        self.hits = 0
        self.priority = 0

    def __lt__(self, other: TreeNode) -> bool:  # heap tie-break; ordering is by the policy tuple first
        return id(self) < id(other)


class RadixCache(PrefixCache):
    enabled = True

    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None], policy: str = "lru") -> None:
        if policy not in ("lru", "lfu", "priority"):
            raise EngineConfigError(f"--eviction-policy {policy!r} is not one of lru, lfu, priority")
        self.page_size = page_size
        self.policy = policy
        self._free_pages = free_pages
        self._roots: dict[str | None, TreeNode] = {}
        self._clock = 0
        self._evictable = 0
        self._protected = 0

    # -- queries -----------------------------------------------------------------------------------------------
    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    def _root(self, extra_key: str | None) -> TreeNode:
        root = self._roots.get(extra_key)
        if root is None:
            root = self._roots[extra_key] = TreeNode((), [], None)
            root.lock_ref = 1  # roots are never evicted
        return root

    def _page_key(self, key: Sequence[int], start: int) -> PageKey:
        return tuple(key[start:start + self.page_size])

    def _common(self, node_key: PageKey, key: Sequence[int], start: int) -> int:
        """Length of the common prefix of node_key and key[start:], rounded down to whole pages."""
        n = min(len(node_key), len(key) - start)
        i = 0
        while i < n and node_key[i] == key[start + i]:
            i += 1
        return i - i % self.page_size

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        self._clock += 1
        limit = len(key) - len(key) % self.page_size
        node = self._root(extra_key)
        pages: list[int] = []
        i = 0
        while i < limit:
            child = node.children.get(self._page_key(key, i))
            if child is None:
                break
            common = self._common(child.key, key, i)
            if common < len(child.key):
                child = self._split(child, common)
            self._touch(child)
            pages.extend(child.pages)
            node = child
            i += common
        return MatchResult(pages, node, self.page_size)

    # -- updates -----------------------------------------------------------------------------------------------
    def insert(self, key: Sequence[int], pages: Sequence[int], extra_key: str | None = None,
               priority: int = 0) -> int:
        if len(key) % self.page_size or len(pages) * self.page_size != len(key):
            raise ValueError(f"insert needs whole pages: {len(key)} tokens, {len(pages)} pages of "
                             f"{self.page_size}")
        self._clock += 1
        node = self._root(extra_key)
        i = 0
        while i < len(key):
            child = node.children.get(self._page_key(key, i))
            if child is None:
                new = TreeNode(tuple(key[i:]), list(pages[i // self.page_size:]), node)
                new.priority = priority
                self._touch(new)
                node.children[new.key[:self.page_size]] = new
                self._evictable += len(new.key)
                return i
            common = self._common(child.key, key, i)
            if common < len(child.key):
                child = self._split(child, common)
            self._touch(child)
            child.priority = max(child.priority, priority)
            node = child
            i += common
        return i

    def _touch(self, node: TreeNode) -> None:
        node.last_access = self._clock
        node.hits += 1

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child`` after ``at`` tokens; returns the new upper node (same lock count, pages re-sliced)."""
        assert 0 < at < len(child.key) and at % self.page_size == 0
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:at], child.pages[:at // self.page_size], parent)
        upper.lock_ref, upper.last_access, upper.hits, upper.priority = (
            child.lock_ref, child.last_access, child.hits, child.priority)
        child.key = child.key[at:]
        child.pages = child.pages[at // self.page_size:]
        child.parent = upper
        upper.children[child.key[:self.page_size]] = child
        parent.children[upper.key[:self.page_size]] = upper
        return upper

    def inc_lock(self, node: TreeNode | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: TreeNode | None) -> None:
        while node is not None and node.parent is not None:
            assert node.lock_ref > 0, "dec_lock without a matching inc_lock"
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def _order(self, node: TreeNode) -> tuple[int, ...]:
        if self.policy == "lfu":
            return (node.hits, node.last_access)
        if self.policy == "priority":
            return (node.priority, node.last_access)
        return (node.last_access,)

    def _evictable_leaves(self) -> list[TreeNode]:
        leaves, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.parent is not None and node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        heap = [(self._order(n), n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and node.lock_ref == 0 and not node.children
            self._free_pages(node.pages)
            freed += len(node.key)
            self._evictable -= len(node.key)
            del parent.children[node.key[:self.page_size]]
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._order(parent), parent))
        return freed

    def owned_pages(self) -> list[int]:
        pages: list[int] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            pages.extend(node.pages)
            stack.extend(node.children.values())
        return pages

    def check_invariants(self) -> None:
        """Recompute sizes and structure from scratch and compare (used by tests)."""
        evictable = protected = 0
        stack = [(r, True) for r in self._roots.values()]
        while stack:
            node, is_root = stack.pop()
            if not is_root:
                assert len(node.key) > 0 and len(node.key) % self.page_size == 0
                assert len(node.pages) * self.page_size == len(node.key)
                assert node.lock_ref >= 0
                assert node.parent is not None and node.parent.children[node.key[:self.page_size]] is node
                assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), \
                    "children hold more locks than their parent"
                if node.lock_ref:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
            stack.extend((c, False) for c in node.children.values())
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"sizes drifted: tree has {evictable}/{protected}, counters {self._evictable}/{self._protected}")
