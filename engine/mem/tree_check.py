"""The radix prefix cache's structure recomputed from scratch (engine/mem/radix_cache.py; used by tests and
the engine's integrity check): read-only walks over the tree's nodes."""
from __future__ import annotations

from collections.abc import Sequence

from engine.mem.tree_node import LoadTicket, PageKey, TreeNode


def tree_entries(roots: dict[str | None, TreeNode]) -> list[tuple[str | None, PageKey, list[int], list[int] | None]]:
    """Every node as (namespace, tokens from the root through it, its L1 pages, its L2 pages)."""
    out = []
    stack = [(ns, (), r) for ns, r in roots.items()]
    while stack:
        ns, prefix, node = stack.pop()
        for child in node.children.values():
            key = prefix + child.key
            out.append((ns, key, list(child.pages), None if child.host is None else list(child.host)))
            stack.append((ns, key, child))
    return out


def check_tree(roots: dict[str | None, TreeNode], page_size: int, sizes: tuple[int, int],
               loads: Sequence[LoadTicket]) -> None:
    """Every node's shape, tiers, locks and loads are consistent, and (evictable, protected) L1 tokens are
    ``sizes``."""
    evictable = protected = 0
    stack = [c for r in roots.values() for c in r.children.values()]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        assert len(node.key) > 0 and len(node.key) % page_size == 0
        pages = len(node.key) // page_size
        assert len(node.pages) in (0, pages) and (node.host is None or len(node.host) == pages)
        assert node.pages or node.host is not None, "a node in no tier"
        assert node.lock_ref >= 0 and node.host_ref >= 0
        assert node.parent is not None and node.parent.children[node.key[:page_size]] is node
        assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), \
            "children hold more locks than their parent"
        if node.loading is not None:
            assert node.host_ref > 0 and any(n is node for n, _ in node.loading.parts) and \
                any(t is node.loading for t in loads), "a node marked loading that no load in flight holds"
        if not node.pages:
            assert node.lock_ref == 0, "a locked node is out of L1"
            assert not any(c.pages for c in node.children.values()), "an L1 node below an L2-only one"
        elif node.lock_ref:
            protected += len(node.key)
        else:
            evictable += len(node.key)
    for t in loads:
        assert t.parent.lock_ref > 0 or t.parent.parent is None, "a load's parent is not locked"
        assert all(n.loading is t for n, _ in t.parts), "a load's node lost its mark"
    assert (evictable, protected) == sizes, f"sizes drifted: tree has {evictable}/{protected}, counters {sizes}"
