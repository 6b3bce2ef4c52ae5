"""RadixAttention's prefix cache: a radix tree over token ids whose edges are whole pages of the device pool
(L1, the pool the runner reads).

- Matching is page-aligned; a match that ends inside a node splits it (pages are re-sliced, never copied).
- ``lock_ref`` on a node protects it and its ancestors; locked tokens count as ``protected_size``, the rest as
  ``evictable_size`` (both count L1 tokens only).
- Eviction frees unlocked L1 leaves, ordered by the policy: lru (oldest access), lfu (fewest hits, then oldest)
  or priority (lowest request priority, then oldest).
- ``extra_key`` namespaces: each key has its own root, so different namespaces never share pages.

``HiRadixCache`` (engine/mem/hiradix_cache.py) puts the same tree over two or three tiers (HiCache); this class
calls its hooks (``_mirror``, ``_evicting``, ``_drop_host``, ``_past_tree``), which do nothing for one tier.
Access times are a logical clock, so behaviour is deterministic."""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from engine.config import EngineConfigError
from engine.mem.base import MatchResult, PrefixCache
from engine.mem.tree_check import check_tree, tree_entries
from engine.mem.tree_node import PageKey, TreeNode


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

    def cached_length(self, key: Sequence[int], extra_key: str | None = None) -> int:
        """Tokens of ``key`` the tree holds in L1 or L2, changing nothing (no split, no touch, no store lookup):
        what a scheduling policy ranks the queue by."""
        node, i, limit = self._roots.get(extra_key), 0, len(key) - len(key) % self.page_size
        while node is not None and i < limit and (child := node.children.get(self._page_key(key, i))) is not None:
            common = self._common(child.key, key, i)
            i, node = i + common, (child if common == len(child.key) else None)
        return i

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        self._clock += 1
        limit = len(key) - len(key) % self.page_size
        node = last_l1 = self._root(extra_key)
        pages: list[int] = []
        host_nodes: list[TreeNode] = []
        i, pending = 0, False
        while i < limit:
            child = node.children.get(self._page_key(key, i))
            if child is None:
                break
            if child.loading is not None and not child.pages:
                pending = True  # a load is bringing it into L1: the caller waits for it (no split meanwhile)
                break
            common = self._common(child.key, key, i)
            if common < len(child.key):
                child = self._split(child, common)
            self._touch(child)
            if child.pages:
                pages.extend(child.pages)
                last_l1 = child
            else:
                host_nodes.append(child)  # L2 only, and so is everything below it
            node = child
            i += common
        pending, stored = self._past_tree(key, limit, extra_key, node, i, pending)
        lower = sum(len(n.key) for n in host_nodes) + len(stored) * self.page_size
        return MatchResult(pages, last_l1, self.page_size, tuple(host_nodes), lower, stored,
                           tuple(key[i:i + len(stored) * self.page_size]), pending)

    # -- updates -----------------------------------------------------------------------------------------------
    def insert(self, key: Sequence[int], pages: Sequence[int], extra_key: str | None = None,
               priority: int = 0) -> int:
        if len(key) % self.page_size or len(pages) * self.page_size != len(key):
            raise ValueError(f"insert needs whole pages: {len(key)} tokens, {len(pages)} pages of "
                             f"{self.page_size}")
        self._clock += 1
        node = self._root(extra_key)
        i, held = 0, None
        while i < len(key):
            child = node.children.get(self._page_key(key, i))
            if child is None:
                new = TreeNode(tuple(key[i:]), list(pages[i // self.page_size:]), node)
                new.priority = priority
                self._touch(new)
                node.children[new.key[:self.page_size]] = new
                self._evictable += len(new.key)
                self._mirror(new)
                return i if held is None else held
            common = self._common(child.key, key, i)
            if common < len(child.key):
                child = self._split(child, common)
            self._touch(child)
            child.priority = max(child.priority, priority)
            if not child.pages:  # L2 only: adopt the caller's pages for it (its L2 copy stays a mirror)
                held = i if held is None else held
                child.pages = list(pages[i // self.page_size:(i + common) // self.page_size])
                self._evictable += len(child.key)
            self._mirror(child)
            node = child
            i += common
        return i if held is None else held

    def _touch(self, node: TreeNode) -> None:
        node.last_access = self._clock
        node.hits += 1

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child`` after ``at`` tokens; returns the new upper node (same locks, pages re-sliced)."""
        assert 0 < at < len(child.key) and at % self.page_size == 0
        parent = child.parent
        assert parent is not None
        cut = at // self.page_size
        upper = TreeNode(child.key[:at], child.pages[:cut], parent)
        upper.lock_ref, upper.host_ref, upper.last_access, upper.hits, upper.priority, upper.stored = (
            child.lock_ref, child.host_ref, child.last_access, child.hits, child.priority, child.stored)
        upper.loading = child.loading
        if child.loading is not None:
            child.loading.split(child, upper, cut)
        if child.host is not None:
            upper.host, child.host = child.host[:cut], child.host[cut:]
        child.key = child.key[at:]
        child.pages = child.pages[cut:]
        child.parent = upper
        upper.children[child.key[:self.page_size]] = child
        parent.children[upper.key[:self.page_size]] = upper
        return upper

    def inc_lock(self, node: TreeNode | None) -> None:
        while node is not None and node.parent is not None:
            assert node.pages, "only L1-resident nodes are locked"
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

    def nodes(self) -> list[TreeNode]:
        out, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.parent is not None:
                out.append(node)
        return out

    @staticmethod
    def _l1_leaf(node: TreeNode) -> bool:
        return bool(node.pages) and not any(c.pages for c in node.children.values())

    def evict(self, num_tokens: int, demote: bool = True) -> int:
        """Free L1 pages of at least ``num_tokens`` unlocked tokens (demoting them when there is a host tier,
        unless not ``demote``)."""
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        heap = [(self._order(n), n) for n in self.nodes() if n.lock_ref == 0 and self._l1_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and node.lock_ref == 0 and self._l1_leaf(node)
            self._evicting(node, demote)
            self._free_pages(node.pages)
            node.pages = []
            freed += len(node.key)
            self._evictable -= len(node.key)
            if node.host is None:
                self._drop(node)
            if parent.parent is not None and parent.lock_ref == 0 and self._l1_leaf(parent):
                heapq.heappush(heap, (self._order(parent), parent))
        return freed

    def _drop(self, node: TreeNode) -> None:
        """Remove ``node`` and everything below it (all of it out of L1); their L2 pages go back."""
        assert node.parent is not None and node.lock_ref == 0
        stack = [node]
        while stack:
            n = stack.pop()
            assert not n.pages and n.host_ref == 0
            stack.extend(n.children.values())
            self._drop_host(n)
        del node.parent.children[node.key[:self.page_size]]

    # -- what a lower tier adds (hiradix_cache.py): nothing here ---------------------------------------------------
    def _past_tree(self, key: Sequence[int], limit: int, extra_key: str | None, node: TreeNode, i: int,
                   pending: bool) -> tuple[bool, tuple[str, ...]]:
        """After a match of ``key[:limit]`` (whole pages) ended at ``node`` after ``i`` tokens: whether it must
        wait for a load in flight, and the keys of the pages a shared store holds after it."""
        return pending, ()

    def _mirror(self, node: TreeNode) -> None:
        """``node`` was inserted or hit: a write policy may copy it to a lower tier now."""

    def _evicting(self, node: TreeNode, demote: bool) -> None:
        """``node`` is about to lose its L1 pages (``demote``: keep them in a lower tier if it has room)."""

    def _drop_host(self, node: TreeNode) -> None:
        """``node`` leaves the tree: give back its lower-tier pages."""

    def flush(self) -> int:
        """Evict everything unlocked; returns the tokens freed."""
        return self.evict(self._evictable, demote=False)

    def entries(self) -> list[tuple[str | None, PageKey, list[int], list[int] | None]]:
        """Every node as (namespace, tokens from the root through it, its L1 pages, its L2 pages)."""
        return tree_entries(self._roots)

    def owned_pages(self) -> list[int]:
        return [p for n in self.nodes() for p in n.pages]

    def check_invariants(self) -> None:
        """Recompute sizes and structure from scratch and compare (used by tests)."""
        check_tree(self._roots, self.page_size, (self._evictable, self._protected), ())
