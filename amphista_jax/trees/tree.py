"""Draft trees as data: a hashable `TreeSpec` (Medusa's "choices"), `TreeBudget` for trees built on device,
and `TreeArrays`, the fixed-size arrays everything downstream of `propose` reads.

A static tree is a list of paths of top-k ranks below the root: `(0,)` is head 1's best token, `(0, 1)` is
head 2's second-best token under it. Nodes are laid out root first, then by (depth, path) as in Medusa's
buffers. For `choices = [(0,), (1,), (0, 0)]` the nodes are `root, (0,), (1,), (0, 0)` and the
ancestor-or-self mask is::

    root   1 0 0 0
    (0,)   1 1 0 0
    (1,)   1 0 1 0
    (0,0)  1 1 0 1

with paths `[[0, 1, 3], [0, 2, -1]]`. Arrays are padded to a fixed budget: `N` nodes, depth `D`, `P` paths.
Padded nodes see only themselves, are seen by no real node, and lie on no path, so they are never attended
to by, nor accepted into, the real tree.

A drafter returns its tree per row (`[B, ...]`) inside its `Proposal`. Static trees (presets, JSON trees,
searched trees) are constant arrays (`tree_arrays`, then `batched`); dynamic trees (EAGLE-2, Gumiho) are
built on device each step from parent pointers (`arrays_from_parents`). Every node's parent precedes it
(`parent[n] < n` for real nodes `n > 0`), which is how a tree grown depth by depth is numbered anyway.

This module is the tree data and its statistics; growing a tree on device (EAGLE-2's frontier, Gumiho's short
paths) is `trees.growth`, and tree names, presets and `auto` are `trees.names`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from amphista_jax.infra.errors import UserError


class TreeError(UserError, ValueError):
    """A draft tree that is not a usable tree."""


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """A static draft tree: sorted, prefix-closed paths of top-k ranks (the root is implicit)."""

    choices: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        paths = tuple(sorted({tuple(int(i) for i in p) for p in self.choices}, key=lambda p: (len(p), p)))
        if len(paths) != len(self.choices):
            raise TreeError(f"tree has duplicate paths: {len(self.choices) - len(paths)} duplicates")
        for p in paths:
            if not p or min(p) < 0:
                raise TreeError(f"tree path {p} must be a non-empty tuple of top-k ranks >= 0")
            if len(p) > 1 and p[:-1] not in set(paths):
                raise TreeError(f"tree path {p} has no parent {p[:-1]}: every prefix must be a node")
        object.__setattr__(self, "choices", paths)

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return len(self.choices) + 1

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.choices), default=0)

    @property
    def leaves(self) -> tuple[tuple[int, ...], ...]:
        prefixes = {p[:-1] for p in self.choices}
        return tuple(p for p in self.choices if p not in prefixes)

    @property
    def num_paths(self) -> int:
        return max(len(self.leaves), 1)

    @property
    def max_children(self) -> int:
        counts: dict[tuple[int, ...], int] = {}
        for p in self.choices:
            counts[p[:-1]] = counts.get(p[:-1], 0) + 1
        return max(counts.values(), default=1)

    @property
    def num_ranks(self) -> int:
        """Top-k ranks `0 .. R-1` that the tree's nodes use (the width of the tree statistics)."""
        return max((p[-1] for p in self.choices), default=0) + 1


@dataclasses.dataclass(frozen=True)
class TreeBudget:
    """The static budget of a tree that a drafter builds on device every step (EAGLE-2, Gumiho): at most
    `num_nodes` nodes (root included) of depth <= `depth`, `num_paths` root-to-leaf paths, `max_children`
    children per node and sibling ranks below `num_ranks`."""

    num_nodes: int
    depth: int
    num_paths: int
    max_children: int
    num_ranks: int

    def __post_init__(self) -> None:
        for name in ("num_nodes", "depth", "num_paths", "max_children", "num_ranks"):
            if getattr(self, name) < 1:
                raise TreeError(f"tree budget {name}={getattr(self, name)} must be >= 1")


Tree = TreeSpec | TreeBudget  # what the engine and a drafter's `propose` receive: static under jit


@struct.dataclass
class TreeArrays:
    """A tree padded to its budget: `[N]`-shaped for a static tree's layout (`tree_arrays`), `[B, N]`-shaped
    per row inside a `Proposal` (`batched`, `arrays_from_parents`)."""

    parent: jax.Array  # [..., N] parent node (root and padding: 0)
    depth: jax.Array  # [..., N] root 0, padding 0
    rank: jax.Array  # [..., N] order among siblings (a static tree's top-k rank); siblings are tried in this order
    valid: jax.Array  # [..., N] bool, real (not padding) nodes
    mask: jax.Array  # [..., N, N] bool, ancestor-or-self
    paths: jax.Array  # [..., P, D + 1] node ids root -> leaf, padded with -1
    max_children: int = struct.field(pytree_node=False, default=1)  # C: width of `children`
    num_ranks: int = struct.field(pytree_node=False, default=1)  # R: `rank < R` (tree statistics are [D, R])

    @property
    def num_nodes(self) -> int:
        return self.mask.shape[-1]

    @property
    def max_depth(self) -> int:
        return self.paths.shape[-1] - 1


@functools.lru_cache(maxsize=64)
def tree_arrays(spec: TreeSpec, num_nodes: int | None = None, num_paths: int | None = None) -> TreeArrays:
    """Lay out `spec` padded to `num_nodes` nodes and `num_paths` paths (default: exactly its size), as numpy
    constants without a batch axis."""
    n = num_nodes or spec.num_nodes
    p = num_paths or spec.num_paths
    if n < spec.num_nodes:
        raise ValueError(f"{num_nodes=} must be >= the tree's {spec.num_nodes} nodes (root included)")
    if p < spec.num_paths:
        raise ValueError(f"{num_paths=} must be >= the tree's {spec.num_paths} root-to-leaf paths")
    index = {(): 0} | {path: i + 1 for i, path in enumerate(spec.choices)}
    rank = np.zeros(n, np.int32)
    parent = np.zeros(n, np.int32)
    depth = np.zeros(n, np.int32)
    mask = np.eye(n, dtype=bool)
    for path, i in index.items():
        if path:
            rank[i], parent[i], depth[i] = path[-1], index[path[:-1]], len(path)
        for d in range(len(path)):
            mask[i, index[path[:d]]] = True
    paths = np.full((p, spec.depth + 1), -1, np.int32)
    leaves = spec.leaves or ((),)
    for row, leaf in enumerate(leaves):
        ids = [index[leaf[:d]] for d in range(len(leaf) + 1)]
        paths[row, : len(ids)] = ids
    valid = np.arange(n) < spec.num_nodes
    return TreeArrays(parent, depth, rank, valid, mask, paths, spec.max_children, spec.num_ranks)


def batched(tree: TreeArrays, batch: int) -> TreeArrays:
    """The same tree for every one of `batch` rows, as device arrays `[B, ...]`."""
    return jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (batch,) + a.shape), tree)


def arrays_from_parents(parent: jax.Array, valid: jax.Array, *, depth: int, num_paths: int, max_children: int,
                        rank: jax.Array | None = None, num_ranks: int | None = None) -> TreeArrays:
    """A tree per row from parent pointers, on device: `parent, valid [B, N]` (node 0 is the root;
    `parent[n] < n` for every real node n > 0; a real node's parent is real) -> `TreeArrays` with its depth,
    ancestor mask and root-to-leaf paths, within the budget `depth` (D), `num_paths` (P), `max_children` (C).

    `rank [B, N]` orders siblings (default: by node id). Real nodes deeper than `depth` must not occur, and a
    row with more than `num_paths` leaves keeps the first `num_paths` (by node id) as paths: the others can
    then never be accepted by the greedy and typical rules, which stays lossless but wastes them.
    """
    b, n = parent.shape
    ids = jnp.arange(n, dtype=jnp.int32)
    valid = valid.at[:, 0].set(True)
    parent = jnp.where(valid & (ids > 0), parent, 0).astype(jnp.int32)
    # Walk up D times from every node: ancestors (mask) and depth.
    mask = jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n))
    cur, node_depth = jnp.broadcast_to(ids, (b, n)), jnp.zeros((b, n), jnp.int32)
    for _ in range(depth):
        up = cur > 0
        cur = jnp.take_along_axis(parent, cur, axis=1)
        node_depth = node_depth + up
        mask = mask | (jax.nn.one_hot(cur, n, dtype=bool) & valid[:, :, None])
    is_child = valid[:, None, :] & (parent[:, None, :] == ids[None, :, None]) & (ids[None, None, :] > 0)  # [B, N, N]
    if rank is None:
        rank = jnp.cumsum(is_child, axis=2) - 1  # [B, N(parent), N(child)] siblings before each child
        rank = jnp.take_along_axis(rank, parent[:, None, :], axis=1)[:, 0]
    rank = jnp.where(valid & (ids > 0), rank, 0).astype(jnp.int32)
    leaf = valid & ~is_child.any(2)  # [B, N]
    order = jnp.argsort(jnp.where(leaf, ids, n + ids), axis=1)[:, :num_paths]  # [B, P] leaves first, by id
    has = jnp.take_along_axis(leaf, order, axis=1)  # [B, P]
    anc = jnp.take_along_axis(mask, order[:, :, None], axis=1)  # [B, P, N] the leaf's ancestors
    at_depth = anc[:, :, None, :] & (node_depth[:, None, None, :] == jnp.arange(depth + 1)[None, None, :, None])
    paths = jnp.where(at_depth.any(3) & has[:, :, None], jnp.argmax(at_depth, axis=3), -1).astype(jnp.int32)
    node_depth = jnp.where(valid, node_depth, 0)
    return TreeArrays(parent, node_depth, rank, valid, mask, paths, max_children,
                      num_ranks if num_ranks is not None else n)


def children(tree: TreeArrays) -> jax.Array:
    """`[B, N, C]` each node's children in rank order (ties by node id), padded with -1."""
    n, c = tree.num_nodes, tree.max_children
    ids = jnp.arange(n)
    is_child = tree.valid[:, None, :] & (tree.parent[:, None, :] == ids[None, :, None]) & (ids[None, None, :] > 0)
    key = jnp.where(is_child, tree.rank[:, None, :] * n + ids[None, None, :], 2 * n * n)  # [B, N, N]
    neg, kids = jax.lax.top_k(-key, min(c, n))  # the C smallest keys
    kids = jnp.where(-neg < 2 * n * n, kids, -1).astype(jnp.int32)
    return jnp.pad(kids, ((0, 0), (0, 0), (0, c - kids.shape[-1])), constant_values=-1)


def tree_statistics(tree: TreeArrays, accepted_nodes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(`tried`, `hit`) `[B, D * R]`: per (depth d + 1, rank r) column `d * R + r`, whether that row's node
    there had its parent on the accepted path (`accepted_nodes [B, D + 1]`, -1 padded), and whether it was
    itself accepted."""
    d, r, n = max(tree.max_depth, 1), tree.num_ranks, tree.num_nodes
    on_path = (accepted_nodes[:, :, None] == jnp.arange(n)[None, None]).any(1)  # [B, N]
    real = tree.valid & (tree.depth > 0)
    column = jax.nn.one_hot((tree.depth - 1) * r + tree.rank, d * r, dtype=jnp.int32) * real[..., None]  # [B, N, DR]
    tried = jnp.take_along_axis(on_path, tree.parent, axis=1)
    return (jnp.einsum("bn,bnc->bc", tried.astype(jnp.int32), column),
            jnp.einsum("bn,bnc->bc", on_path.astype(jnp.int32), column))


@dataclasses.dataclass(frozen=True)
class TreeLevel:
    """The nodes of one depth of a static tree, in the layout a depth-by-depth drafter uses (numpy)."""

    nodes: np.ndarray  # [C] node ids at this depth
    parent_slot: np.ndarray  # [C] each node's parent among the previous level's expanded nodes
    rank: np.ndarray  # [C] its top-k rank under that parent
    expand: np.ndarray  # [M] indices into `nodes` of the nodes that have children (the next level's parents)


@functools.lru_cache(maxsize=64)
def tree_levels(spec: TreeSpec) -> tuple[TreeLevel, ...]:
    """Depth 1 .. D of a static tree; depth 1's parent is the root (the single expanded node of depth 0)."""
    arrays = tree_arrays(spec)
    depth, parent, valid, rank = arrays.depth, arrays.parent, arrays.valid, arrays.rank
    expanded = np.asarray([0])  # node ids of the previous level's nodes that have children
    levels = []
    for d in range(1, spec.depth + 1):
        nodes = np.flatnonzero(valid & (depth == d))
        slot = {int(p): i for i, p in enumerate(expanded)}
        has_children = {int(p) for p in parent[valid & (depth == d + 1)]}
        expand = np.asarray([i for i, node in enumerate(nodes) if node in has_children], np.int64)
        levels.append(TreeLevel(nodes, np.asarray([slot[int(parent[c])] for c in nodes]), rank[nodes], expand))
        expanded = nodes[expand]
    return tuple(levels)


def fill_tree_from_topk(root: jax.Array, topk: jax.Array, spec: TreeSpec) -> jax.Array:
    """Node tokens `[B, N]` of a static tree for heads that draft independently: node n gets rank `rank[n]` of
    head `depth[n] - 1` (`topk [B, K, k]`); node 0 gets the root."""
    arrays = tree_arrays(spec)
    tokens = topk[:, np.maximum(arrays.depth - 1, 0), arrays.rank]  # [B, N]
    return tokens.at[:, 0].set(root)


def chain(depth: int) -> TreeSpec:
    """A single path of each head's top-1 token (`depth` draft tokens)."""
    return TreeSpec(tuple((0,) * d for d in range(1, depth + 1)))


def fan(branches: int, depth: int) -> TreeSpec:
    """The root's top-`branches` children, each the head of a chain of `depth` first children (`branches * depth`
    draft nodes): distinct guesses of the next token, each carried on alone (prompt lookup's several matches)."""
    if branches < 1 or depth < 1:
        raise TreeError(f"fan tree: {branches=} and {depth=} must be >= 1")
    return TreeSpec(tuple((r,) + (0,) * d for r in range(branches) for d in range(depth)))


def efficient_tree(depth: int, top_k: int) -> TreeSpec:
    """BiTA's "efficient" token tree (its figure 5): the top-`top_k` candidates at every depth up to `depth`, all
    children of the previous depth's top-1 candidate (`depth * top_k` draft nodes). Tree search calibrates on it."""
    if depth < 1 or top_k < 1:
        raise TreeError(f"efficient tree: {depth=} and {top_k=} must be >= 1")
    return TreeSpec(tuple((0,) * d + (r,) for d in range(depth) for r in range(top_k)))
