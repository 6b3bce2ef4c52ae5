"""HiCache's prefix cache: RadixCache's tree over two tiers (L1 = the device pool the runner reads, L2 = a host
pool, ``tier``), and a shared store (L3) under the host tier when the tier has one.

A node holds ``pages`` (L1 pages, or none) and ``host`` (L2 pages, or None); it lives in at least one tier.
L1-resident nodes form a prefix of every root-to-leaf path: eviction demotes L1 leaves first and load-back
promotes from the top. Evicting an L1 node demotes it (write_back copies it to L2 then; under write_through
every inserted node was mirrored already; write_through_selective mirrors a node once it was inserted
``write_threshold`` times). ``match_prefix`` reports the L2-only continuation of a match and ``start_load``
copies it into fresh L1 pages on the tier's loader thread: the pages belong to the load (a ``LoadTicket``) until
``finish_loads``, on the engine thread, attaches them (``load_back`` does both at once). A node being loaded
keeps its L2 pages (``host_ref``), its L1 parent is locked, and a match that reaches it is ``pending`` (it stops
there, splitting nothing); an insert meanwhile gives it the inserter's pages and the load's copy goes back. L2
is full: mirrors of L1 nodes and L2-only leaves are dropped in LRU order, never a node being loaded. With a
store, a node is written there when it reaches L2, and a match continues past the tree with the pages the
store holds (a load reads them into a new node)."""
from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from engine.mem.base import MatchResult
from engine.mem.hicache import HostTier
from engine.mem.radix_cache import RadixCache
from engine.mem.tree_check import check_tree
from engine.mem.tree_node import STORED, LoadTicket, PageKey, TreeNode

log = logging.getLogger(__name__)


class HiRadixCache(RadixCache):
    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None], policy: str,
                 tier: HostTier) -> None:
        super().__init__(page_size, free_pages, policy)
        self.tier = tier
        self._loads: list[LoadTicket] = []  # load-backs in flight, oldest first
        self._stored_loads: dict[tuple[int, PageKey], LoadTicket] = {}  # (id of the node, first page) -> load

    def _past_tree(self, key: Sequence[int], limit: int, extra_key: str | None, node: TreeNode, i: int,
                   pending: bool) -> tuple[bool, tuple[str, ...]]:
        pending = pending or (i < limit and (id(node), self._page_key(key, i)) in self._stored_loads)
        if self.tier.store is None or i >= limit or pending:
            return pending, ()
        return pending, tuple(self.tier.stored_run(extra_key, key[:limit], i // self.page_size))

    # -- load-back --------------------------------------------------------------------------------------------------
    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    def start_load(self, match: MatchResult, inline_under_s: float = 0.0) -> MatchResult | None:
        """Start copying the match's L2-only continuation, then the pages the store holds after it, into fresh L1
        pages (as far as L1 has room, evicting unlocked entries) on the tier's loader thread; the tree takes them
        in ``finish_loads``. Meanwhile the match's L1 part is locked, the L2 part's host pages are kept
        (``host_ref``) and a match that reaches them is ``pending``. A copy from L2 alone is made here and
        attached at once when a background copy would not overlap the step (``tier.overlap``) or the tier
        expects it to take under ``inline_under_s``. None if a load runs in the background, else the match
        extended by what was copied here (unchanged if nothing could load)."""
        got = self._load(match, inline_under_s)
        return None if isinstance(got, LoadTicket) else self._extended(match, got)

    def load_back(self, match: MatchResult) -> MatchResult:
        """Load as ``start_load`` does and wait for it here: returns the match extended by what was loaded."""
        got = self._load(match, math.inf)
        return self._extended(match, self._finish(got) if isinstance(got, LoadTicket) else got)

    def _extended(self, match: MatchResult, got: tuple[TreeNode, list[int]] | None) -> MatchResult:
        if got is None:
            return match
        node, taken = got
        return MatchResult(list(match.pages) + taken, node, self.page_size)

    def _load(self, match: MatchResult, inline_under_s: float) -> LoadTicket | tuple[TreeNode, list[int]] | None:
        """The load of ``start_load``: its ticket if it runs in the background, what it attached if it was made
        here (as ``_finish`` returns it), None if nothing could load."""
        tier = self.tier
        if match.pending or not (match.host_nodes or match.stored_keys):
            return None
        self.inc_lock(match.node)  # the L1 part must not be demoted to make room, nor while the copies run
        for n in match.host_nodes:  # nor the L2 part dropped
            n.host_ref += 1
        parts: list[tuple[TreeNode, list[int]]] = []
        for n in match.host_nodes:
            assert not n.pages and n.host is not None and n.loading is None
            self._make_room(len(n.host))
            new = tier.alloc_device(len(n.host))
            if new is None:
                break
            parts.append((n, new))
        for n in match.host_nodes[len(parts):]:
            n.host_ref -= 1
        stored_at = parts[-1][0] if parts else match.node
        ticket = LoadTicket(match.node, parts, stored_at)
        if match.stored_keys and len(parts) == len(match.host_nodes):  # every L2 node loads: the store goes on
            self._make_room(len(match.stored_keys))
            got = tier.alloc_device(min(len(match.stored_keys), tier.device_available())) or []
            if got:
                ticket.stored_keys, ticket.stored_pages = match.stored_keys[:len(got)], got
                ticket.stored_tokens = match.stored_tokens[:len(got) * self.page_size]
                self._stored_loads[(id(stored_at), self._page_key(ticket.stored_tokens, 0))] = ticket
        if not ticket.pages():
            self.dec_lock(match.node)
            return None
        for n, _ in parts:
            n.loading = ticket
        copies = [(n.host or [], new) for n, new in parts]
        self._loads.append(ticket)
        quick = not tier.overlap or tier.copy_seconds(len(ticket.pages())) < inline_under_s
        inline = quick and not ticket.stored_pages
        ticket.future = Future()
        try:
            if inline:
                ticket.future.set_result(tier.copy_in(copies, (), ()))
            else:
                ticket.future = tier.start_load(copies, ticket.stored_keys, ticket.stored_pages)
        except Exception as e:  # noqa: BLE001 - _finish logs it and gives the pages back
            ticket.future.set_exception(e)
            inline = True
        return self._finish(ticket) if inline else ticket

    def _make_room(self, pages: int) -> None:
        """Evict unlocked L1 entries until ``pages`` pages are free (or nothing more can go)."""
        if self.tier.device_available() < pages:
            self.evict((pages - self.tier.device_available()) * self.page_size)

    def finish_loads(self, wait: bool = False) -> int:
        """Hand the pages of every finished load (every load, waiting for them, with ``wait``) to the tree;
        returns how many loads finished."""
        done = [t for t in self._loads if wait or (t.future is not None and t.future.done())]
        for t in done:
            self._finish(t)
        return len(done)

    def _finish(self, t: LoadTicket) -> tuple[TreeNode, list[int]]:
        """Attach a load's pages where their nodes still lack L1 pages (a node that got pages meanwhile from an
        insert keeps those; the load's copies go back), the stored pages as a new child unless one was
        inserted there; returns the deepest node now in L1 and the pages it took, in order."""
        assert t.future is not None
        self._loads.remove(t)
        for n, _ in t.parts:  # first what must be undone whatever happens below
            n.host_ref -= 1
            n.loading = None
        if t.stored_pages:
            del self._stored_loads[(id(t.stored_at), self._page_key(t.stored_tokens, 0))]
        try:
            return self._attach(t)
        finally:
            self.dec_lock(t.parent)

    def _attach(self, t: LoadTicket) -> tuple[TreeNode, list[int]]:
        assert t.future is not None
        try:
            out = t.future.result()
        except Exception:  # noqa: BLE001 - a bug in a copy: the prefix is recomputed, the engine goes on
            log.exception("hicache load-back failed; recomputing the prefix")
            out = None
        node, taken, tokens = t.parent, [], 0
        for n, pages in t.parts:
            if out is not None and not n.pages:
                assert n.parent is node
                n.pages = pages
                self._evictable += len(n.key)
                tokens += len(n.key)
            else:
                self._free_pages(pages)
            if out is not None:
                node = n
                taken.extend(n.pages)
        if t.stored_pages:
            first = self._page_key(t.stored_tokens, 0)
            got = 0 if out is None else out.stored
            if got and node is t.stored_at and first not in node.children:
                child = TreeNode(tuple(t.stored_tokens[:got * self.page_size]), t.stored_pages[:got], node)
                child.stored = STORED
                self._touch(child)
                node.children[first] = child
                self._evictable += len(child.key)
                self._free_pages(t.stored_pages[got:])
                node = child
                taken.extend(child.pages)
                self._mirror(child)
            else:
                self._free_pages(t.stored_pages)
        if out is not None:
            self.tier.finish_load(out, tokens)
        return node, taken

    # -- the host tier ---------------------------------------------------------------------------------------------
    def _evicting(self, node: TreeNode, demote: bool) -> None:
        if node.host is None and demote:
            self._demote(node)

    def _drop_host(self, node: TreeNode) -> None:
        if node.host is not None:
            self.tier.free_host(node.host)
            node.host = None

    def _mirror(self, node: TreeNode) -> None:
        """Copy an L1 node to L2 now if the write policy says so (write_through, or selective past the threshold);
        write it to the store again if its write there failed (once: a retry that fails is not retried)."""
        tier = self.tier
        if node.stored > 0 and node.pages and tier.write_failed(node.stored):
            self._write_store(node, retry=True)
        if node.host is None and tier.mirrors(node.hits):
            self._demote(node)

    def _demote(self, node: TreeNode) -> None:
        """Give an L1 node an L2 copy, dropping L2 entries as needed; leaves it without one if L2 is all held."""
        tier = self.tier
        assert node.pages and node.host is None
        need = len(node.pages)
        if tier.host_available() < need:
            self._evict_host(need - tier.host_available(), keep=node)
        slots = tier.alloc_host(need)
        if slots is not None:
            tier.save(node.pages, slots)
            node.host = slots
        if tier.store is not None and not node.stored:
            self._write_store(node)

    def _write_store(self, node: TreeNode, retry: bool = False) -> None:
        ns, prefix = self._path(node)
        node.stored = self.tier.write_store(ns, prefix, node.pages, retry)

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

        heap = [(n.last_access, n) for n in self.nodes() if droppable(n)]
        heapq.heapify(heap)
        freed = 0
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
        """Finish the loads in flight, evict everything unlocked from L1 and drop every L2 copy; returns L1 tokens
        freed."""
        self.finish_loads(wait=True)
        freed = super().flush()
        for node in self.nodes():  # the topmost L2-only nodes, each with its subtree
            parent = node.parent
            assert parent is not None
            if not node.pages and (parent.parent is None or parent.pages):
                self._drop(node)
        for node in self.nodes():
            if node.host is not None:
                self.tier.free_host(node.host)
                node.host = None
        return freed

    def owned_pages(self) -> list[int]:
        return super().owned_pages() + [p for t in self._loads for p in t.pages()]

    def host_owned_pages(self) -> list[int]:
        return [p for n in self.nodes() for p in (n.host or ())]

    def check_invariants(self) -> None:
        """Recompute sizes and structure from scratch and compare (used by tests)."""
        check_tree(self._roots, self.page_size, (self._evictable, self._protected), self._loads)
        self.tier.check_integrity(self.host_owned_pages())
