"""Trees grown on device every step, per row, inside a static `TreeBudget`: EAGLE-2's context-aware dynamic
tree (frontiers kept by cumulative draft log-probability, `draft_dynamic_tree`, `grow_dynamic_tree`) and
Gumiho's lossless lengthening of short paths (`extend_short_paths`). A drafter supplies `expand`, which runs
one frontier through its draft layer; the result is parent pointers, turned into `TreeArrays` by
`trees.arrays_from_parents`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from amphista_jax.trees.tree import TreeArrays, TreeBudget, TreeError, arrays_from_parents


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
                       keep: int, fanout: Sequence[tuple[int, int]], root_ids: jax.Array | None = None) -> DraftedTree:
    """EAGLE-2's context-aware dynamic tree, per row on device, keeping the best `keep` drafted nodes.

    `fanout[d - 1] = (children, width)` for depth d = 1 .. D: each node of the depth d - 1 frontier proposes
    its best `children` children (the root alone is the depth-0 frontier; its children come from
    `root_logprobs [B, V]`, whose column c is token `root_ids[c]` (None: token c), e.g. a draft vocabulary),
    scored by cumulative log-probability, and the best `width` of them form the
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
    child = child if root_ids is None else root_ids[child]
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
                      budget: TreeBudget, root_ids: jax.Array | None = None) -> tuple[jax.Array, TreeArrays]:
    """EAGLE-2 (`draft_dynamic_tree`) within `budget`: top-k = `budget.max_children` children and frontiers at
    every depth down to `budget.depth`, `budget.num_nodes - 1` kept (`root_ids`: as there). Returns node tokens
    `[B, N]` and the tree."""
    k = budget.max_children
    if budget.num_ranks < k:
        raise TreeError(f"tree budget {budget}: num_ranks < max_children")
    tree = draft_dynamic_tree(root, root_logprobs, root_carry, expand, memory, budget.num_nodes - 1,
                              ((k, k),) * budget.depth, root_ids)
    return tree.tokens, arrays_from_parents(tree.parent, jnp.ones(tree.parent.shape, bool), depth=budget.depth,
                                            num_paths=budget.num_paths, max_children=k, num_ranks=budget.num_ranks)
