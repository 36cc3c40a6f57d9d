"""Drafting a tree with a drafter's own cached stack of layers: the mechanism EAGLE, EAGLE-2, EAGLE-3, Gumiho's
serial part and draft models share.

A `CachedStack` keeps its own KV cache in step with the target's (`causal_layers.py`); its state holds `base`, the
stack's output for the root. `FeatureDrafting` drafts one step's tree with it: each depth of the tree runs through
the stack in one call (`expand`), at drafter position `lengths + d - 1` for a node of depth d, seeing the committed
cache, its ancestors' keys/values from earlier calls of this step (scratch, `PrefixKV`) and itself. A static
`TreeSpec` is filled depth by depth (`static`: top-k, or i.i.d. draws with their `q` at a temperature); a
`TreeBudget` is grown by EAGLE-2's builder (`dynamic`, `trees.growth.grow_dynamic_tree`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.drafters.base import DraftContext, Proposal
from amphista_jax.drafters.draft_vocab import target_ids, to_target, to_vocab
from amphista_jax.models.cache import KVCache
from amphista_jax.models.llama import PrefixKV
from amphista_jax.models.target import Target
from amphista_jax.trees.growth import Expansion, grow_dynamic_tree
from amphista_jax.trees.tree import TreeBudget, TreeSpec, batched, tree_arrays, tree_levels


class CachedStack(Protocol):
    """A drafter with its own cached stack that `FeatureDrafting` drives (EAGLE's layers, a whole draft model).
    Its state holds `base` (the stack's output for the root: its children's draft distribution) and `caches[0]`,
    whose committed prefix ends just before depth 1 (a node of depth d sits at `lengths + d - 1`). `logprobs` are
    over its `draft_vocab` (`()`: the whole vocabulary)."""

    draft_vocab: tuple[int, ...]

    def run_nodes(self, params: Any, target: Target, tokens: jax.Array, parent_features: jax.Array,
                  positions: jax.Array, cache: KVCache, new_mask: jax.Array,
                  prefix: PrefixKV | None) -> tuple[jax.Array, KVCache, jax.Array | None]: ...

    def logprobs(self, params: Any, target: Target, features: jax.Array) -> jax.Array: ...


@dataclasses.dataclass
class FeatureDrafting:
    """One step's tree drafting: expansions of the drafter's cached stack over tree nodes, each depth in one
    call, with the earlier depths' keys/values of this step as scratch that only their descendants see."""

    drafter: CachedStack
    params: dict
    target: Target
    ctx: DraftContext

    def logprobs(self, features: jax.Array) -> jax.Array:
        return self.drafter.logprobs(self.params, self.target, features)

    def top_k(self, logprobs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """(scores, target token ids) `[..., k]` of the `k` best of `logprobs [..., V_d]`."""
        score, index = jax.lax.top_k(logprobs, k)
        return score, to_target(index.astype(jnp.int32), self.drafter.draft_vocab)

    def expand(self, tokens: jax.Array, parent_features: jax.Array, depth: int, sees: jax.Array,
               scratch: tuple[jax.Array, jax.Array] | None
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array], jax.Array | None]:
        """Run `M` nodes of tree depth `depth` (tokens `[B, M]`, their parents' predicted features `[B, M, D]`)
        in one call; `sees [B, M, S]`: which `scratch` slots (earlier calls' nodes; None: there are none) each
        one sees. Returns their predicted features `[B, M, D]`, their keys/values `[L, B, M, KVH, Dh]` and their
        stack inputs `[B, M, D]` (None for a stack whose inputs are its tokens alone)."""
        cache = self.ctx.state["caches"][0]
        b, m = tokens.shape
        positions = jnp.broadcast_to(cache.lengths[:, None] + depth - 1, (b, m))
        prefix = PrefixKV(*scratch, sees) if scratch is not None and scratch[0].shape[2] else None
        own = jnp.broadcast_to(jnp.eye(m, dtype=bool), (b, m, m))
        out, written, inputs = self.drafter.run_nodes(self.params, self.target, tokens, parent_features, positions,
                                                      cache, own, prefix)

        def new_entries(layer: jax.Array) -> jax.Array:  # [L, B, S, KVH, Dh] -> [L, B, M, KVH, Dh]
            return jax.vmap(lambda c, s: jax.lax.dynamic_slice_in_dim(c, s, m, 1), (1, 0), 1)(layer, cache.lengths)

        return out, (new_entries(written.k), new_entries(written.v)), inputs

    def static(self, spec: TreeSpec, rng: jax.Array | None = None, temperature: float = 0.0,
               p_min: float = 0.0) -> Proposal:
        """A static tree, depth by depth: each expanded node's children are the top-k of its own draft
        distribution (EAGLE; `q = None`), or, with `temperature > 0`, independent draws from that distribution at
        `temperature` (one per child rank; siblings may repeat), which the proposal passes on as each child's `q`
        for lossless rejection sampling.

        `p_min > 0` stops drafting where the draft is unsure (llama.cpp's `p_min`): a node's children are drafted
        only when the most likely token of the distribution they are drawn from has probability >= `p_min` (and
        the node itself was drafted). The others stay in the padded tree as invalid nodes (`TreeArrays.valid`,
        per row), which no acceptance rule accepts, and a depth none of whose nodes in any row is drafted skips its
        forward (`lax.cond`), so nothing recompiles and an unsure step costs fewer forwards. The rule reads the
        parent's distribution, never the drawn token, so the children that are drafted are still i.i.d. draws
        from their `q`: greedy, typical and rejection sampling stay lossless."""
        b, n, vocab = self.ctx.root.shape[0], spec.num_nodes, self.drafter.draft_vocab
        levels, arrays = tree_levels(spec), batched(tree_arrays(spec), b)
        sees = _static_scratch_visibility(spec)  # [depth, M_d, S]
        tokens = jnp.zeros((b, n), jnp.int32).at[:, 0].set(self.ctx.root)
        valid = arrays.valid  # [B, N] which nodes are drafted
        q = None
        features = self.ctx.state["base"][:, None]  # [B, M, D] predicted features of the expanded nodes
        logprobs = self.logprobs(features)  # [B, M, V_d] their children's draft distributions
        scratch = _empty_scratch(self.ctx.state["caches"][0], b, sum(len(lv.expand) for lv in levels[:-1]))
        used = 0
        for depth, level in enumerate(levels, start=1):
            k = int(level.rank.max()) + 1
            dist = logprobs  # [B, M, V_d] what this depth's children are drawn from
            if temperature > 0:
                dist = jax.nn.log_softmax(logprobs / temperature, axis=-1)
                draws = jax.random.categorical(jax.random.fold_in(rng, depth), dist, shape=(k,) + dist.shape[:-1])
                top = to_target(jnp.moveaxis(draws, 0, -1).astype(jnp.int32), vocab)  # [B, M, k] i.i.d. per parent
                probs = to_vocab(jnp.exp(dist), vocab, self.target.config.vocab_size)  # [B, M, V]
                q = (jnp.zeros((b, n) + probs.shape[-1:], jnp.float32) if q is None else q).at[:, level.nodes].set(
                    probs[:, level.parent_slot])
            else:
                top = self.top_k(logprobs, k)[1]  # [B, M, k]
            children = top[:, level.parent_slot, level.rank]  # [B, C]
            tokens = tokens.at[:, level.nodes].set(children)
            if p_min > 0:
                sure = jnp.exp(dist.max(-1)) >= p_min  # [B, M]
                parent_node = arrays.parent[:, level.nodes]  # [B, C]
                drafted = jnp.take_along_axis(valid, parent_node, 1) & sure[:, level.parent_slot]
                valid = valid.at[:, level.nodes].set(drafted)
            if not len(level.expand):
                break
            m = len(level.expand)
            parents = features[:, level.parent_slot[level.expand]]
            visible = jnp.broadcast_to(sees[depth - 1], (b,) + sees[depth - 1].shape)

            def expand(children: jax.Array, parents: jax.Array, scratch: tuple, depth: int = depth,
                       visible: jax.Array = visible) -> tuple:
                features, kv, _ = self.expand(children, parents, depth, visible, scratch)
                return features, kv, self.logprobs(features)

            operands = (children[:, level.expand], parents, scratch)
            if p_min > 0:
                skip = functools.partial(_zeros, jax.eval_shape(expand, *operands))
                features, kv, logprobs = jax.lax.cond(valid[:, level.nodes[level.expand]].any(), expand, skip,
                                                      *operands)
            else:
                features, kv, logprobs = expand(*operands)
            scratch = tuple(s.at[:, :, used: used + m].set(x) for s, x in zip(scratch, kv, strict=True))
            used += m
        return Proposal(tokens, arrays.replace(valid=valid), q)

    def dynamic(self, budget: TreeBudget) -> Proposal:
        """EAGLE-2 (`trees.growth.grow_dynamic_tree`): each frontier runs through the layer in one call, its
        keys/values kept as this step's scratch at the slots the builder assigns."""
        base, b = self.ctx.state["base"], self.ctx.root.shape[0]
        scratch = _empty_scratch(self.ctx.state["caches"][0], b, (budget.depth - 1) * budget.max_children)
        tokens, arrays = grow_dynamic_tree(self.ctx.root, self.logprobs(base), base, self.expansion, scratch, budget,
                                           target_ids(self.drafter.draft_vocab))
        return Proposal(tokens, arrays)

    def expansion(self, tokens: jax.Array, parent_features: jax.Array, level: Expansion, sees: jax.Array,
                  scratch: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array, tuple]:
        """`trees.growth.Expand`: a frontier through the layer; its children are its top-k drafts."""
        features, kv, _ = self.expand(tokens, parent_features, level.depth, sees, scratch)
        end = level.offset + level.width
        scratch = tuple(x.at[:, :, level.offset: end].set(y) for x, y in zip(scratch, kv, strict=True))
        score, child = self.top_k(self.logprobs(features), level.children)
        return score, child, features, scratch


def _zeros(shapes: Any, *_: Any) -> Any:
    """Zeros of the shapes and dtypes `shapes` holds (a skipped expansion's outputs)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


def _empty_scratch(cache: KVCache, batch: int, slots: int) -> tuple[jax.Array, jax.Array]:
    shape = (cache.k.shape[0], batch, slots) + cache.k.shape[3:]
    return jnp.zeros(shape, cache.k.dtype), jnp.zeros(shape, cache.v.dtype)


@functools.lru_cache(maxsize=64)
def _static_scratch_visibility(spec: TreeSpec) -> tuple[np.ndarray, ...]:
    """Per depth d (1-based) of a static tree, `[M_d, S]`: which scratch slots (the expanded nodes of depths
    < d, in expansion order) each expanded node of depth d sees: its ancestors'."""
    arrays, levels = tree_arrays(spec), tree_levels(spec)
    slot_nodes = np.concatenate([lv.nodes[lv.expand] for lv in levels[:-1]] + [np.zeros(0, np.int64)])
    return tuple(arrays.mask[np.ix_(lv.nodes[lv.expand], slot_nodes)] & (lv.nodes[lv.expand][:, None] != slot_nodes)
                 for lv in levels)
