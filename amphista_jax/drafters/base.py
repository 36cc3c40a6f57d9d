"""The draft-method contract (DESIGN section 3): pure functions over pytrees, so that the decode loop and
the trainer never branch on a method's name.

A drafter is a frozen (hashable) dataclass of its static settings, with these methods:

* `init(rng, target_config, target_params) -> params`
* `init_state(batch, cache_size) -> state`: the method's own caches (zeros) or `()`.
* `prefill(params, target_params, target_out, prompt_lengths, state) -> state`
* `propose(params, target_params, ctx, tree, rng) -> Proposal`: fill the tree's `N` node tokens.
* `commit(params, target_params, verdict, verify_out, state) -> state`: catch the method's caches up with
  the accepted tokens.
* `loss(params, target_params, batch, target_out) -> (loss, metrics)`: the training objective.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
from flax import struct

from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output
from amphista_jax.trees import TreeArrays
from amphista_jax.verify import Verdict


@struct.dataclass
class DraftContext:
    hidden: jax.Array  # [B, D] target's last-layer hidden state at the node that produced `root`
    root: jax.Array  # [B] the target's own next token (tree node 0)
    lengths: jax.Array  # [B] committed tokens; the root sits at position `lengths`
    state: Any  # the method's own state


@struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, N] node tokens; node 0 is the root
    q: jax.Array | None = None  # [B, N, V] draft distribution per node, None = deterministic (top-k) drafts


class Drafter(Protocol):
    def init(self, rng: jax.Array, target_config: ModelConfig, target_params: dict) -> Any: ...

    def init_state(self, batch: int, cache_size: int) -> Any: ...

    def prefill(self, params: Any, target_params: dict, target_out: Output, prompt_lengths: jax.Array,
                state: Any) -> Any: ...

    def propose(self, params: Any, target_params: dict, ctx: DraftContext, tree: TreeArrays,
                rng: jax.Array) -> Proposal: ...

    def commit(self, params: Any, target_params: dict, verdict: Verdict, verify_out: Output, state: Any) -> Any: ...

    def loss(self, params: Any, target_params: dict, batch: dict, target_out: Output) -> tuple[jax.Array, dict]: ...


def fill_tree_from_topk(root: jax.Array, topk: jax.Array, tree: TreeArrays) -> jax.Array:
    """Node tokens `[B, N]` for heads that draft independently: node n gets rank `topk_index[n]` of head
    `head_index[n]` (`topk [B, K, k]`); node 0 gets the root."""
    head = jax.numpy.maximum(jax.numpy.asarray(tree.head_index), 0)
    tokens = topk[:, head, jax.numpy.asarray(tree.topk_index)]  # [B, N]
    return tokens.at[:, 0].set(root)
