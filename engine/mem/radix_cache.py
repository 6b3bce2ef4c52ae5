"""RadixAttention's prefix cache: a radix tree over token ids whose edges are whole pages, optionally over two
tiers (HiCache: L1 = the device pool the runner reads, L2 = a host pool; ``tier`` given at construction).

- Matching is page-aligned; a match that ends inside a node splits it (pages are re-sliced, never copied).
- ``lock_ref`` on a node protects it and its ancestors; locked tokens count as ``protected_size``, the rest as
  ``evictable_size`` (both count L1 tokens only).
- Eviction frees unlocked L1 leaves, ordered by the policy: lru (oldest access), lfu (fewest hits, then oldest)
  or priority (lowest request priority, then oldest).
- ``extra_key`` namespaces: each key has its own root, so different namespaces never share pages.

With a host tier a node holds ``pages`` (L1 pages, or none) and ``host`` (L2 pages, or None); it lives in at
least one tier. L1-resident nodes form a prefix of every root-to-leaf path: eviction demotes L1 leaves first
and load-back promotes from the top. Evicting an L1 node demotes it (write_back copies it to L2 then; under
write_through every inserted node was mirrored already; write_through_selective mirrors a node once it was
inserted ``write_threshold`` times). ``match_prefix`` reports the L2-only continuation of a match and
``load_back`` copies it into fresh L1 pages. L2 is full: mirrors of L1 nodes and L2-only leaves are dropped in
LRU order (``host_ref`` protects a node being loaded). With a shared store (L3) under the host tier, a node
is written there when it reaches L2, and a match continues past the tree with the pages the store holds
(``load_back`` reads them into a new node). Access times are a logical clock, so behaviour is deterministic."""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from engine.config import EngineConfigError
from engine.mem.base import MatchResult, PrefixCache
from engine.mem.hicache import HostTier
from engine.mem.tree_node import PageKey, TreeNode


class RadixCache(PrefixCache):
    enabled = True

    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None], policy: str = "lru",
                 tier: HostTier | None = None) -> None:
        if policy not in ("lru", "lfu", "priority"):
            raise EngineConfigError(f"--eviction-policy {policy!r} is not one of lru, lfu, priority")
        self.page_size = page_size
        self.policy = policy
        self.tier = tier
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
        i = 0
        while i < limit:
            child = node.children.get(self._page_key(key, i))
            if child is None:
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
        lower = sum(len(n.key) for n in host_nodes)
        stored: list[str] = []
        if self.tier is not None and self.tier.store is not None and i < limit:
            stored = self.tier.stored_run(extra_key, key[:limit], i // self.page_size)
            lower += len(stored) * self.page_size
        return MatchResult(pages, last_l1, self.page_size, tuple(host_nodes), lower, tuple(stored),
                           tuple(key[i:i + len(stored) * self.page_size]))

    def load_back(self, match: MatchResult) -> MatchResult:
        """Copy the match's L2-only continuation, then the pages the shared store holds after it, into fresh L1
        pages (as far as L1 has room, evicting unlocked entries); returns the match extended by what was loaded."""
        if not (match.host_nodes or match.stored_keys) or self.tier is None:
            return match
        tier = self.tier
        self.inc_lock(match.node)  # the L1 part must not be demoted to make room
        for n in match.host_nodes:
            n.host_ref += 1
        pages, node, loaded = list(match.pages), match.node, 0
        try:
            for n in match.host_nodes:
                assert not n.pages and n.host is not None and n.parent is node
                need = len(n.host)
                if tier.device_available() < need:
                    self.evict((need - tier.device_available()) * self.page_size)
                new = tier.alloc_device(need)
                if new is None:
                    break
                try:
                    tier.load(n.host, new)
                except BaseException:
                    self._free_pages(new)
                    raise
                n.pages = new
                self._evictable += len(n.key)
                self.inc_lock(n)  # hold it while its children load (dropped with the rest below)
                self.dec_lock(node)
                pages.extend(new)
                node, loaded = n, loaded + len(n.key)
            else:  # every L2 node came back: the store may continue the match
                if match.stored_keys:
                    node, got = self._load_stored(node, match)
                    pages.extend(got)
        finally:
            self.dec_lock(node)
            for n in match.host_nodes:
                n.host_ref -= 1
        tier.loaded(loaded)
        return MatchResult(pages, node, self.page_size)

    def _load_stored(self, node: TreeNode, match: MatchResult) -> tuple[TreeNode, list[int]]:
        """Read the match's stored pages into fresh L1 pages as a new child of ``node`` (locked in its place);
        returns the deepest node and the pages loaded (fewer than asked where an entry was missing or bad)."""
        tier = self.tier
        assert tier is not None
        need = len(match.stored_keys)
        if tier.device_available() < need:
            self.evict((need - tier.device_available()) * self.page_size)
        new = tier.alloc_device(min(need, tier.device_available())) or []
        try:
            got = tier.read_store(match.stored_keys, new) if new else 0
        except BaseException:
            self._free_pages(new)
            raise
        assert got <= len(new)
        first = self._page_key(match.stored_tokens, 0)
        if got == 0 or first in node.children:
            self._free_pages(new)
            return node, []
        self._free_pages(new[got:])
        child = TreeNode(tuple(match.stored_tokens[:got * self.page_size]), new[:got], node)
        child.stored = True
        self._touch(child)
        node.children[first] = child
        self._evictable += len(child.key)
        self.inc_lock(child)
        self.dec_lock(node)
        self._mirror(child)
        return child, new[:got]

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

    def _nodes(self) -> list[TreeNode]:
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
        heap = [(self._order(n), n) for n in self._nodes() if n.lock_ref == 0 and self._l1_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and node.lock_ref == 0 and self._l1_leaf(node)
            if self.tier is not None and node.host is None and demote:
                self._demote(node)
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
            if n.host is not None and self.tier is not None:
                self.tier.free_host(n.host)
                n.host = None
        del node.parent.children[node.key[:self.page_size]]

    # -- the host tier ---------------------------------------------------------------------------------------------
    def _mirror(self, node: TreeNode) -> None:
        """Copy an L1 node to L2 now if the write policy says so (write_through, or selective past the threshold)."""
        tier = self.tier
        if tier is None or node.host is not None or not tier.mirrors(node.hits):
            return
        self._demote(node)

    def _demote(self, node: TreeNode) -> None:
        """Give an L1 node an L2 copy, dropping L2 entries as needed; leaves it without one if L2 is all held."""
        tier = self.tier
        assert tier is not None and node.pages and node.host is None
        need = len(node.pages)
        if tier.host_available() < need:
            self._evict_host(need - tier.host_available(), keep=node)
        slots = tier.alloc_host(need)
        if slots is not None:
            tier.save(node.pages, slots)
            node.host = slots
        if tier.store is not None and not node.stored:
            ns, prefix = self._path(node)
            node.stored = tier.write_store(ns, prefix, node.pages)

    def _path(self, node: TreeNode) -> tuple[str | None, PageKey]:
        """``node``'s namespace and the tokens from its root through it."""
        parts, n = [], node
        while n.parent is not None:
            parts.append(n.key)
            n = n.parent
        ns = next(k for k, root in self._roots.items() if root is n)
        return ns, tuple(t for part in reversed(parts) for t in part)

    def _evict_host(self, pages: int, keep: TreeNode) -> None:
        """Free at least ``pages`` L2 pages: drop mirrors of L1 nodes and L2-only leaves, least recent first."""
        def droppable(n: TreeNode) -> bool:
            return n.host is not None and n.host_ref == 0 and n is not keep and (bool(n.pages) or not n.children)

        heap = [(n.last_access, n) for n in self._nodes() if droppable(n)]
        heapq.heapify(heap)
        freed = 0
        assert self.tier is not None
        while heap and freed < pages:
            _, node = heapq.heappop(heap)
            if not droppable(node):
                continue
            freed += len(node.host or ())
            parent = node.parent
            if node.pages:
                self.tier.free_host(node.host or [])
                node.host = None
            else:
                self._drop(node)
                if parent is not None and parent.parent is not None and droppable(parent):
                    heapq.heappush(heap, (parent.last_access, parent))

    def flush(self) -> int:
        """Evict everything unlocked from L1 and drop every L2 copy; returns L1 tokens freed."""
        freed = self.evict(self._evictable, demote=False)
        if self.tier is None:
            return freed
        for node in self._nodes():  # the topmost L2-only nodes, each with its subtree
            parent = node.parent
            assert parent is not None
            if not node.pages and (parent.parent is None or parent.pages):
                self._drop(node)
        for node in self._nodes():
            if node.host is not None:
                self.tier.free_host(node.host)
                node.host = None
        return freed

    def entries(self) -> list[tuple[str | None, PageKey, list[int], list[int] | None]]:
        """Every node as (namespace, tokens from the root through it, its L1 pages, its L2 pages)."""
        out = []
        stack = [(ns, (), r) for ns, r in self._roots.items()]
        while stack:
            ns, prefix, node = stack.pop()
            for child in node.children.values():
                key = prefix + child.key
                out.append((ns, key, list(child.pages), None if child.host is None else list(child.host)))
                stack.append((ns, key, child))
        return out

    def owned_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def host_owned_pages(self) -> list[int]:
        return [p for n in self._nodes() for p in (n.host or ())]

    def check_invariants(self) -> None:
        """Recompute sizes and structure from scratch and compare (used by tests)."""
        evictable = protected = 0
        for node in self._nodes():
            assert len(node.key) > 0 and len(node.key) % self.page_size == 0
            pages = len(node.key) // self.page_size
            assert len(node.pages) in (0, pages) and (node.host is None or len(node.host) == pages)
            assert node.pages or node.host is not None, "a node in no tier"
            assert node.lock_ref >= 0 and node.host_ref >= 0
            assert node.parent is not None and node.parent.children[node.key[:self.page_size]] is node
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), \
                "children hold more locks than their parent"
            if not node.pages:
                assert node.lock_ref == 0, "a locked node is out of L1"
                assert not any(c.pages for c in node.children.values()), "an L1 node below an L2-only one"
            elif node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self._evictable, self._protected), (
            f"sizes drifted: tree has {evictable}/{protected}, counters {self._evictable}/{self._protected}")
        if self.tier is not None:
            self.tier.check_integrity(self.host_owned_pages())
