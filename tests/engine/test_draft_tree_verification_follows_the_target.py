"""A draft tree's verification: the walk from the root follows, at each node, the child holding the token the
target sampled there (one of several branches, or none), the accepted path's K/V moves to the offsets a chain
would have used, and the speculator orders a tree's nodes by expected acceptance with parents first, so the
cost model's cut keeps a subtree."""
from __future__ import annotations

import random

from engine.spec.speculator import _by_value
from engine.spec.tree import DraftTree, depths, moves, path, walk

# root -> 10 -> 11 -> 12      (nodes 0, 1, 2)
#      -> 20 -> 21            (nodes 3, 4)
#         10 -> 13            (node 5, a sibling of 11)
TREE = DraftTree((10, 11, 12, 20, 21, 13), (-1, 0, 1, -1, 3, 0), (0.6, 0.6, 0.6, 0.4, 0.4, 0.1))


def test_the_walk_takes_the_branch_holding_each_sampled_token() -> None:
    # sampled: after the root, then after nodes 0..5
    assert walk(TREE.tokens, TREE.parents, [20, 0, 0, 0, 21, 9, 0]) == ([20, 21, 9], [3, 4])
    assert walk(TREE.tokens, TREE.parents, [10, 13, 0, 0, 0, 0, 7]) == ([10, 13, 7], [0, 5])
    assert walk(TREE.tokens, TREE.parents, [10, 11, 12, 5, 0, 0, 0]) == ([10, 11, 12, 5], [0, 1, 2])
    assert walk(TREE.tokens, TREE.parents, [30, 0, 0, 0, 0, 0, 0]) == ([30], [])


def test_a_chain_is_the_tree_whose_parents_are_the_nodes_before() -> None:
    assert walk((1, 2, 3), (), [1, 2, 9, 9]) == walk((1, 2, 3), (-1, 0, 1), [1, 2, 9, 9]) == ([1, 2, 9], [0, 1])
    assert depths((), 3) == [1, 2, 3] and path((), 2) == [0, 1, 2]
    assert DraftTree.chain([4, 5]).is_chain and not TREE.is_chain


def test_only_an_accepted_path_out_of_storage_order_moves() -> None:
    assert moves([0, 1, 2]) == []
    assert moves([3, 4]) == [(4, 1), (5, 2)]
    assert moves([0, 5]) == [(6, 2)]


def test_nodes_are_ordered_by_value_with_every_parent_before_its_children() -> None:
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randrange(1, 12)
        parents = tuple(rng.randrange(-1, i) for i in range(n))
        tree = DraftTree(tuple(rng.randrange(50) for _ in range(n)), parents,
                         tuple(rng.random() for _ in range(n)))
        ordered, values = _by_value(tree, rng.choice([1.0, 0.8, 0.3]))
        assert values == sorted(values, reverse=True)
        assert all(p < i for i, p in enumerate(ordered.parents))
        paths = {tuple(tree.tokens[j] for j in path(tree.parents, i)) for i in range(n)}
        assert {tuple(ordered.tokens[j] for j in path(ordered.parents, i)) for i in range(n)} == paths
        for cut in range(n + 1):  # every prefix is a tree: its nodes' parents are in it
            assert all(p < cut for p in ordered.prefix(cut).parents)
