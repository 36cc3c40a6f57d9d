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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from amphista_jax.errors import UserError

PRESET_DIR = Path(__file__).parent / "assets" / "trees"


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


@dataclasses.dataclass(frozen=True)
class Expansion:
    """One call of a dynamic tree's `expand`: the frontier of depth `depth` (`width` nodes) proposes
    `children` children each; its nodes may keep keys/values at scratch slots `[offset, offset + width)`."""

    depth: int
    width: int
    children: int
    offset: int


# (frontier tokens [B, w], their parents' carry (a pytree of [B, w, ...]), the expansion, sees [B, w, S], memory)
#   -> (children log-probabilities [B, w, c] (best first), children tokens [B, w, c], the frontier's carry, memory)
Expand = Callable[[jax.Array, Any, Expansion, jax.Array, Any], tuple[jax.Array, jax.Array, Any, Any]]


def dynamic_tree(total_tokens: int = 60, depth: int = 6, top_k: int = 10) -> TreeBudget:
    """The budget of EAGLE-2's dynamic tree (`grow_dynamic_tree`): `total_tokens` drafted nodes, at most
    `depth` below the root, frontiers and children of `top_k` (the paper's defaults 60, 6, 10)."""
    return TreeBudget(num_nodes=total_tokens + 1, depth=depth, num_paths=total_tokens, max_children=top_k,
                      num_ranks=top_k)


@struct.dataclass
class DraftedTree:
    """The nodes a dynamic tree kept, root first, parents before children: `[B, K + 1]` each."""

    tokens: jax.Array
    parent: jax.Array  # the root's is 0
    score: jax.Array  # cumulative draft log-probability (the root's is 0)
    depth: jax.Array


def draft_dynamic_tree(root: jax.Array, root_logprobs: jax.Array, root_carry: Any, expand: Expand, memory: Any,
                       keep: int, fanout: Sequence[tuple[int, int]]) -> DraftedTree:
    """EAGLE-2's context-aware dynamic tree, per row on device, keeping the best `keep` drafted nodes.

    `fanout[d - 1] = (children, width)` for depth d = 1 .. D: each node of the depth d - 1 frontier proposes
    its best `children` children (the root alone is the depth-0 frontier; its children come from
    `root_logprobs [B, V]`), scored by cumulative log-probability, and the best `width` of them form the
    depth-d frontier. `expand` runs a frontier in one call (tokens, the parents' carry, starting from
    `root_carry [B, ...]`); it may keep the frontier's keys/values in `memory` at its expansion's scratch
    slots, and `sees [B, w, S]` marks each frontier node's ancestors among the earlier frontiers' slots.
    Finally the best `keep` of every drafted node (the frontiers and all their proposed children) are kept: a
    child never scores above its parent and `lax.top_k` keeps the lower (earlier-drafted) index on ties, so
    the kept set holds every kept node's ancestors. Nodes are numbered in drafting order (parents first;
    siblings by rank).
    """
    depth = len(fanout)
    drafted = sum(c * (fanout[d - 1][1] if d else 1) for d, (c, _) in enumerate(fanout))
    if keep > drafted:
        raise TreeError(f"a dynamic tree of fan-out {tuple(fanout)} drafts {drafted} nodes, fewer than the {keep} to "
                        "keep: raise the depth or the top-k")
    b = root.shape[0]
    offsets = np.cumsum([0] + [w for _, w in fanout[:-1]])  # scratch slots of each expanded frontier
    slots = int(offsets[-1])
    children = fanout[0][0]
    child_score, child = jax.lax.top_k(root_logprobs, children)
    child_score, child = child_score[:, None], child[:, None].astype(jnp.int32)  # [B, 1 (the root), c]
    frontier = jnp.full((b, 1), -1, jnp.int32)  # candidate ids of the frontier (the root: -1)
    carry = jax.tree.map(lambda x: x[:, None], root_carry)
    sees = jnp.zeros((b, 1, slots), bool)
    scores, tokens, parents, depths, start = [], [], [], [], 0
    for d in range(1, depth + 1):
        width = frontier.shape[1]
        child_score = child_score.reshape(b, width * children)
        scores.append(child_score)
        tokens.append(child.reshape(b, width * children))
        parents.append(jnp.repeat(frontier, children, axis=1))
        depths.append(np.full(width * children, d))
        score, pick = jax.lax.top_k(child_score, fanout[d - 1][1])  # the depth-d frontier
        row = pick // children  # its parents' rows in the previous frontier
        token = jnp.take_along_axis(tokens[-1], pick, 1)
        frontier = start + pick
        start += width * children
        carry = jax.tree.map(lambda x, r=row: jnp.take_along_axis(x, r.reshape(r.shape + (1,) * (x.ndim - 2)), 1),
                             carry)
        if d == depth:
            break
        sees = jnp.take_along_axis(sees, row[:, :, None], 1)
        if d > 1:  # the parents (depth d - 1) sit at the previous expansion's slots
            sees = sees | jax.nn.one_hot(int(offsets[d - 2]) + row, slots, dtype=bool)
        children = fanout[d][0]
        level = Expansion(d, token.shape[1], children, int(offsets[d - 1]))
        child_score, child, carry, memory = expand(token, carry, level, sees, memory)
        child_score = score[:, :, None] + child_score
    scores, tokens, parents = (jnp.concatenate(x, 1) for x in (scores, tokens, parents))  # [B, drafted]
    kept_score, kept = jax.lax.top_k(scores, keep)
    order = jnp.argsort(kept, axis=1)  # drafting order: parents first
    kept, kept_score = jnp.take_along_axis(kept, order, 1), jnp.take_along_axis(kept_score, order, 1)
    node_of = jnp.zeros((b, drafted), jnp.int32).at[jnp.arange(b)[:, None], kept].set(
        jnp.arange(1, keep + 1, dtype=jnp.int32))
    parent = jnp.take_along_axis(parents, kept, 1)
    parent = jnp.where(parent < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(parent, 0), 1))
    zero = jnp.zeros((b, 1), jnp.int32)
    return DraftedTree(jnp.concatenate([root[:, None], jnp.take_along_axis(tokens, kept, 1)], 1),
                       jnp.concatenate([zero, parent], 1), jnp.concatenate([zero.astype(scores.dtype), kept_score], 1),
                       jnp.concatenate([zero, jnp.asarray(np.concatenate(depths), jnp.int32)[kept]], 1))


def extend_short_paths(tree: DraftedTree, extra: int, depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gumiho's Full Tree Attention, made lossless: (tokens, parent, valid) `[B, K + 1 + extra]`.

    The published FTA lengthens a short candidate path by pointing it at tokens of other, longer paths and
    reusing their logits and keys/values, which were computed under other ancestors. Here the borrowed tokens
    become new nodes below the short path's leaf, so the verify forward scores them under the right context.
    For each depth j the borrowed token is the best-scoring kept node's at depth j (parallel heads draft each
    depth independently of the one before, which is what makes borrowing sensible); short leaves (depth <
    `depth`), best score first, are extended down to `depth` (or to the first depth with no kept node) while
    the `extra` slots last; unused slots are padding (`valid = False`).
    """
    b, n = tree.tokens.shape
    ids = jnp.arange(n, dtype=jnp.int32)
    has_child = jnp.zeros((b, n), bool).at[jnp.arange(b)[:, None], tree.parent[:, 1:]].set(True)
    short = ~has_child & (ids > 0) & (tree.depth < depth)  # [B, N]
    at = tree.depth[:, :, None] == jnp.arange(depth + 1)  # [B, N, D + 1]
    best = jnp.argmax(jnp.where(at, tree.score[:, :, None], -jnp.inf), axis=1)  # [B, D + 1] node per depth
    borrow = jnp.take_along_axis(tree.tokens, best, 1)
    present = at.any(1)  # [B, D + 1]
    run = [jnp.zeros((b,), jnp.int32)]  # run[D - d]: consecutive depths d + 1, d + 2, ... that have a node
    for d in range(depth - 1, -1, -1):
        run.append(jnp.where(present[:, d + 1], run[-1] + 1, 0))
    reach = jnp.stack(run[::-1], 1)  # [B, D + 1]
    need = jnp.where(short, jnp.take_along_axis(reach, tree.depth, 1), 0)
    order = jnp.argsort(jnp.where(need > 0, -tree.score, jnp.inf), axis=1)  # leaves to extend, best first
    need = jnp.take_along_axis(need, order, 1)
    end = jnp.cumsum(need, axis=1)
    need = jnp.where(end <= extra, need, 0)  # the leaves that fit, a prefix of `order`
    end = jnp.cumsum(need, axis=1)
    slot = jnp.arange(extra, dtype=jnp.int32)
    leaf_rank = jax.vmap(lambda e: jnp.searchsorted(e, slot, side="right"))(end)  # [B, extra]
    valid = slot[None] < end[:, -1:]
    leaf_rank = jnp.minimum(leaf_rank, n - 1)
    leaf = jnp.take_along_axis(order, leaf_rank, 1)
    step = slot[None] - (jnp.take_along_axis(end, leaf_rank, 1) - jnp.take_along_axis(need, leaf_rank, 1))
    node_depth = jnp.take_along_axis(tree.depth, leaf, 1) + 1 + step
    tokens = jnp.take_along_axis(borrow, jnp.minimum(node_depth, depth), 1)
    parent = jnp.where(step == 0, leaf, n + slot[None] - 1)
    return (jnp.concatenate([tree.tokens, jnp.where(valid, tokens, 0)], 1),
            jnp.concatenate([tree.parent, jnp.where(valid, parent, 0)], 1),
            jnp.concatenate([jnp.ones((b, n), bool), valid], 1))


def grow_dynamic_tree(root: jax.Array, root_logprobs: jax.Array, root_carry: Any, expand: Expand, memory: Any,
                      budget: TreeBudget) -> tuple[jax.Array, TreeArrays]:
    """EAGLE-2 (`draft_dynamic_tree`) within `budget`: top-k = `budget.max_children` children and frontiers at
    every depth down to `budget.depth`, `budget.num_nodes - 1` kept. Returns node tokens `[B, N]` and the tree."""
    k = budget.max_children
    if budget.num_ranks < k:
        raise TreeError(f"tree budget {budget}: num_ranks < max_children")
    tree = draft_dynamic_tree(root, root_logprobs, root_carry, expand, memory, budget.num_nodes - 1,
                              ((k, k),) * budget.depth)
    return tree.tokens, arrays_from_parents(tree.parent, jnp.ones(tree.parent.shape, bool), depth=budget.depth,
                                            num_paths=budget.num_paths, max_children=k, num_ranks=budget.num_ranks)


def chain(depth: int) -> TreeSpec:
    """A single path of each head's top-1 token (`depth` draft tokens)."""
    return TreeSpec(tuple((0,) * d for d in range(1, depth + 1)))


def efficient_tree(depth: int, top_k: int) -> TreeSpec:
    """BiTA's "efficient" token tree (its figure 5): the top-`top_k` candidates at every depth up to `depth`, all
    children of the previous depth's top-1 candidate (`depth * top_k` draft nodes). Tree search calibrates on it."""
    if depth < 1 or top_k < 1:
        raise TreeError(f"efficient tree: {depth=} and {top_k=} must be >= 1")
    return TreeSpec(tuple((0,) * d + (r,) for d in range(depth) for r in range(top_k)))


def load_tree(path: str | Path) -> TreeSpec:
    """A tree from a JSON list of paths (e.g. `[[0], [0, 0], [1]]`) with at least one draft node."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise TreeError(f"tree file {path} is not JSON ({e.msg} at line {e.lineno}, column {e.colno}): it must "
                        "hold a list of paths, e.g. [[0], [1], [0, 0]]") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TreeError(f"tree file {path} cannot be read ({e}): pass a JSON file of paths") from None
    if not isinstance(data, list) or not all(isinstance(p, list) and all(isinstance(i, int) for i in p)
                                             for p in data):
        raise TreeError(f"{path} must hold a JSON list of paths of integer ranks, e.g. [[0], [1], [0, 0]]")
    if not data:
        raise TreeError(f"tree file {path} has no draft nodes (an empty tree is autoregressive decoding): add "
                        "paths, e.g. [[0], [1], [0, 0]], or use a preset")
    return TreeSpec(tuple(tuple(p) for p in data))


PRESETS: dict[str, TreeSpec] = {
    "mc_sim_7b_63": load_tree(PRESET_DIR / "medusa_mc_sim_7b_63.json"),
    "chain-1": chain(1),
    "chain-4": chain(4),
    "small-8": TreeSpec(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
    "small-16": TreeSpec(((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0),
                          (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0))),
}


AUTO = "auto"
PAPER_TREE = "mc_sim_7b_63"  # what a method drafts unless its paper names another tree (a drafter's `paper_tree`)


def searched_tree_path(heads_dir: str | Path, backend: str | None = None) -> Path:
    """Where `amphista-jax tree-search` writes the tree searched for these heads on this device class."""
    return Path(heads_dir) / "trees" / f"{backend or jax.default_backend()}.json"


DYNAMIC = "dynamic"  # EAGLE-2's budget with the paper's defaults; `dynamic-TxDxK` sets them
EFFICIENT = "efficient"  # `efficient-DxK`: BiTA's efficient tree of depth D, top-K per depth


def _sizes(name: str, kind: str, what: str, form: str, example: str) -> list[int]:
    """The sizes in a tree name `<kind>-<form>` (positive integers joined by `x`, e.g. `dynamic-60x6x10`)."""
    sizes = name[len(kind) + 1:].split("x")
    if len(sizes) == form.count("x") + 1 and all(s.isascii() and s.isdigit() and int(s) >= 1 for s in sizes):
        return [int(s) for s in sizes]
    raise TreeError(f"tree {name!r}: {what} reads {kind}-{form} (each >= 1), e.g. {kind}-{example}")


def get_tree(name_or_path: str, heads_dir: str | Path | None = None) -> Tree:
    """A preset by name, a JSON file of paths, `auto` (the tree searched for the heads in `heads_dir` on this
    device class (`amphista-jax tree-search`), else the tree of the heads' paper, with a note on stderr), BiTA's
    efficient tree `efficient-DxK`, or the budget of a tree grown on device every step: `dynamic` (60 nodes,
    depth 6, top-10) or `dynamic-TxDxK`."""
    if name_or_path == AUTO:
        path = searched_tree_path(heads_dir) if heads_dir is not None else None
        if path is not None and path.is_file():
            return load_tree(path)
        why = (f"no tree was searched for {heads_dir} on {jax.default_backend()} (`amphista-jax tree-search --heads "
               f"{heads_dir}` searches one)" if heads_dir is not None else "untrained heads have no searched tree")
        from amphista_jax.drafters.io import heads_paper_tree  # the drafters import this module

        fallback = PAPER_TREE if heads_dir is None else heads_paper_tree(heads_dir)
        print(f"note: tree auto: {why}; using {fallback}", file=sys.stderr)
        return get_tree(fallback)
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if Path(name_or_path).is_file():
        return load_tree(name_or_path)
    if name_or_path.startswith("chain-") and name_or_path[6:].isdigit() and int(name_or_path[6:]) >= 1:
        return chain(int(name_or_path[6:]))
    if name_or_path == DYNAMIC:
        return dynamic_tree()
    if name_or_path.startswith(DYNAMIC + "-"):
        return dynamic_tree(*_sizes(name_or_path, DYNAMIC, "a dynamic budget (drafted nodes x depth x top-k)",
                                   "TxDxK", "60x6x10"))
    if name_or_path.startswith(EFFICIENT + "-"):
        return efficient_tree(*_sizes(name_or_path, EFFICIENT, "an efficient tree (depth x top-k)", "DxK", "3x5"))
    raise TreeError(f"unknown tree {name_or_path!r}: use a preset ({', '.join(PRESETS)}, chain-N, efficient-DxK), a "
                    "JSON file of paths, or a dynamic budget (dynamic, dynamic-TxDxK)")
