"""Tree layouts: the papers' 63-node preset, literal masks, and random trees (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amphista_jax.trees.names import PRESETS, get_tree
from amphista_jax.trees.tree import TreeSpec, batched, children, tree_arrays


def test_mc_sim_7b_63_preset():
    spec = PRESETS["mc_sim_7b_63"]
    arrays = tree_arrays(spec)
    assert spec.num_nodes == 64 and spec.num_paths == 42 and spec.depth == 4
    assert [int((arrays.depth == d).sum()) for d in range(1, 5)] == [10, 28, 23, 2]
    assert arrays.paths.shape == (42, 5)


def test_small_tree_literal_arrays():
    arrays = tree_arrays(TreeSpec(((1,), (0,), (0, 0))), num_nodes=6, num_paths=3)
    np.testing.assert_array_equal(arrays.mask.astype(int), [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ])
    np.testing.assert_array_equal(arrays.parent, [0, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(arrays.depth, [0, 1, 1, 2, 0, 0])
    np.testing.assert_array_equal(arrays.rank, [0, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(arrays.paths, [[0, 2, -1], [0, 1, 3], [-1, -1, -1]])
    np.testing.assert_array_equal(arrays.valid, [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(children(batched(arrays, 1))[0], [[1, 2], [3, -1], [-1, -1], [-1, -1], [-1, -1],
                                                                    [-1, -1]])


def test_invalid_trees_are_rejected():
    with pytest.raises(ValueError, match="has no parent"):
        TreeSpec(((0,), (1, 0)))
    with pytest.raises(ValueError, match="duplicate"):
        TreeSpec(((0,), (0,)))
    with pytest.raises(ValueError, match="must be >= the tree's 3 nodes"):
        tree_arrays(TreeSpec(((0,), (1,))), num_nodes=2)
    with pytest.raises(ValueError, match="unknown tree"):
        get_tree("no-such-tree")


@st.composite
def random_trees(draw):
    nodes: set[tuple[int, ...]] = set()
    frontier = [()]
    for _ in range(draw(st.integers(1, 30))):
        parent = draw(st.sampled_from(frontier))
        if len(parent) >= 5:
            continue
        child = parent + (draw(st.integers(0, 4)),)
        if child not in nodes:
            nodes.add(child)
            frontier.append(child)
    return TreeSpec(tuple(nodes)), draw(st.integers(0, 5))


@settings(max_examples=60, deadline=None)
@given(random_trees())
def test_random_tree_mask_is_the_ancestor_relation(tree_and_pad):
    spec, pad = tree_and_pad
    arrays = tree_arrays(spec, num_nodes=spec.num_nodes + pad, num_paths=spec.num_paths + 1)
    n = spec.num_nodes
    for i in range(n + pad):
        ancestors = {i}
        j = i
        while i < n and j != 0:
            j = int(arrays.parent[j])
            ancestors.add(j)
        np.testing.assert_array_equal(np.flatnonzero(arrays.mask[i]), sorted(ancestors))
        if i >= n:  # padding: seen by nobody else, on no path
            assert arrays.mask[:, i].sum() == 1 and i not in arrays.paths
    for path in arrays.paths:
        ids = path[path >= 0]
        if len(ids):
            assert ids[0] == 0 and all(arrays.parent[b] == a for a, b in zip(ids[:-1], ids[1:], strict=True))
            assert all(arrays.depth[x] == d for d, x in enumerate(ids))
