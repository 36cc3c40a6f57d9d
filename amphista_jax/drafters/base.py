"""The draft-method contract (DESIGN section 3): pure functions over pytrees, so that the decode loop and
the trainer never branch on a method's name.

A drafter is a frozen (hashable) dataclass of its static settings, with these methods:

* `init(rng, target_config, target_params) -> params`
* `init_state(batch, cache_size) -> state`: the method's own caches (zeros) or `()`.
* `prefill(params, target_params, target_out, prompt_lengths, state) -> state`
* `propose(params, target_params, ctx, tree, rng) -> Proposal`: fill the tree's `N` node tokens.
* `commit(params, target_params, verdict, verify_out, state) -> (state, next_hidden)`: catch the method's
  caches up with the accepted tokens and choose the hidden state `[B, D]` the next proposal starts from
  (usually the target's at the last accepted node: `accepted_hidden`).
* `loss(params, target_params, batch, target_out) -> (loss, metrics)`: the training objective.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
from flax import struct

from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output
from amphista_jax.trees import TreeArrays
from amphista_jax.verify import Verdict, last_accepted_node


@struct.dataclass
class DraftContext:
    hidden: jax.Array  # [B, D] target's last-layer hidden state at the node that produced `root`
    root: jax.Array  # [B] the target's own next token (tree node 0)
    lengths: jax.Array  # [B] committed tokens; the root sits at position `lengths`
    state: Any  # the method's own state


@struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, N] node tokens; node 0 is the root
    # [B, N, V] the distribution each node's token was drawn from; siblings must be i.i.d. draws from their
    # shared q. None = deterministic (top-k) drafts (see verify.py).
    q: jax.Array | None = None


class Drafter(Protocol):
    def init(self, rng: jax.Array, target_config: ModelConfig, target_params: dict) -> Any: ...

    def init_state(self, batch: int, cache_size: int) -> Any: ...

    def prefill(self, params: Any, target_params: dict, target_out: Output, prompt_lengths: jax.Array,
                state: Any) -> Any: ...

    def propose(self, params: Any, target_params: dict, ctx: DraftContext, tree: TreeArrays,
                rng: jax.Array) -> Proposal: ...

    def commit(self, params: Any, target_params: dict, verdict: Verdict, verify_out: Output,
               state: Any) -> tuple[Any, jax.Array]: ...

    def loss(self, params: Any, target_params: dict, batch: dict, target_out: Output) -> tuple[jax.Array, dict]: ...


def accepted_hidden(verdict: Verdict, verify_out: Output) -> jax.Array:
    """`[B, D]` the target's hidden state at the deepest accepted node (the one that produced the bonus)."""
    return jax.numpy.take_along_axis(verify_out.hidden, last_accepted_node(verdict)[:, None, None], axis=1)[:, 0]


def fill_tree_from_topk(root: jax.Array, topk: jax.Array, tree: TreeArrays) -> jax.Array:
    """Node tokens `[B, N]` for heads that draft independently: node n gets rank `topk_index[n]` of head
    `head_index[n]` (`topk [B, K, k]`); node 0 gets the root."""
    head = jax.numpy.maximum(jax.numpy.asarray(tree.head_index), 0)
    tokens = topk[:, head, jax.numpy.asarray(tree.topk_index)]  # [B, N]
    return tokens.at[:, 0].set(root)
