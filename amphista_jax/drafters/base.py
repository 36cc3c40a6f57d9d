"""The draft-method contract (DESIGN section 3): pure functions over pytrees, so that the decode loop and
the trainer never branch on a method's name.

A drafter is a frozen (hashable) dataclass of its static settings, with these methods (`target` is the
frozen model: `Target(config, params)`, whose config is static under `jax.jit`):

* `init(rng, target) -> params`
* `init_state(target_config, batch, cache_size) -> state`: the method's own caches (zeros) or `()`.
* `prefill(params, target, prompt: PrefillContext, state) -> state`: run the method's own layers
  over the prompt (Amphista's staged adaptation layers fill their caches here).
* `propose(params, target, ctx, tree, rng) -> Proposal`: the tree's `N` node tokens and the tree itself as
  per-row device data (`TreeArrays [B, ...]`). `tree` is the static `TreeSpec` (a preset, JSON or searched
  tree: the drafter fills it) or a `TreeBudget` (a drafter that grows its own tree every step stays inside
  it); both are static under `jax.jit`.
* `commit(params, target, proposal, verdict, verify_out, state) -> (state, next_hidden)`: catch the
  method's caches up with the accepted tokens (the path `verdict.accepted_nodes` of `proposal.tokens`, then
  `verdict.bonus`) and choose the hidden state `[B, D]` the next proposal starts from (usually the
  target's at the last accepted node: `accepted_hidden`).
* `loss(params, target, batch, target_out) -> (loss, metrics)`: the training objective. `batch` holds
  `tokens [B, T]` and `loss_mask [B, T]`; in a train step (never in evaluation) also `rng`, a key for
  training-time randomness (Hydra's embedding noise).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import optax
from flax import struct

from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output
from amphista_jax.trees import Tree, TreeArrays, TreeError, TreeSpec, batched, fill_tree_from_topk, tree_arrays
from amphista_jax.verify import Verdict, last_accepted_node


@struct.dataclass
class Target:
    """The frozen target model a drafter works on: its (static) config and its params."""

    config: ModelConfig = struct.field(pytree_node=False)
    params: dict


@struct.dataclass
class DraftContext:
    hidden: jax.Array  # [B, D] target's last-layer hidden state at the node that produced `root`
    root: jax.Array  # [B] the target's own next token (tree node 0)
    lengths: jax.Array  # [B] committed tokens; the root sits at position `lengths`
    state: Any  # the method's own state


@struct.dataclass
class PrefillContext:
    out: Output  # the target over the padded prompt slots: hidden [B, T, D]
    prompt: jax.Array  # [B, T] right-padded prompt tokens
    lengths: jax.Array  # [B] prompt lengths
    root: jax.Array  # [B] the target's first generated token (at position `lengths`)


@struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, N] node tokens; node 0 is the root
    tree: TreeArrays  # [B, ...] per row: what the verify forward, acceptance and compaction read
    # [B, N, V] the distribution each node's token was drawn from; siblings must be i.i.d. draws from their
    # shared q. None = deterministic (top-k) drafts (see verify.py).
    q: jax.Array | None = None


class Drafter(Protocol):
    def init(self, rng: jax.Array, target: Target) -> Any: ...

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> Any: ...

    def prefill(self, params: Any, target: Target, prompt: PrefillContext, state: Any) -> Any: ...

    def propose(self, params: Any, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal: ...

    def commit(self, params: Any, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: Any) -> tuple[Any, jax.Array]: ...

    def loss(self, params: Any, target: Target, batch: dict, target_out: Output) -> tuple[jax.Array, dict]: ...


def accepted_hidden(verdict: Verdict, verify_out: Output) -> jax.Array:
    """`[B, D]` the target's hidden state at the deepest accepted node (the one that produced the bonus)."""
    return jax.numpy.take_along_axis(verify_out.hidden, last_accepted_node(verdict)[:, None, None], axis=1)[:, 0]


def accepted_tokens(proposal: Proposal, verdict: Verdict) -> jax.Array:
    """`[B, D + 1]` the tokens that follow each accepted node: the next accepted node's token, and the bonus
    after the last one (entries past `n_accepted` are the bonus too; callers mask them)."""
    path = jax.numpy.take_along_axis(proposal.tokens, jax.numpy.maximum(verdict.accepted_nodes, 0), 1)  # [B, D+1]
    idx = jax.numpy.arange(path.shape[1])[None]
    return jax.numpy.where(idx < verdict.n_accepted[:, None] - 1, jax.numpy.roll(path, -1, axis=1),
                           verdict.bonus[:, None])


def check_tree_depth(tree: Tree, num_heads: int, method: str) -> TreeSpec:
    """Trace-time: heads that fill a static tree need one (not a `TreeBudget`), and a tree of depth D needs D
    heads (head k drafts depth k + 1). Returns the tree."""
    if not isinstance(tree, TreeSpec):
        raise TreeError(f"{method} heads fill a static tree (a preset, a JSON file of paths or a searched tree), "
                        f"not a budget for trees built on device: got {tree}")
    depth = tree.depth
    if depth > num_heads:
        raise TreeError(f"tree depth {depth} needs {depth} heads but these {method} heads have {num_heads=}: "
                         f"pick a tree of depth <= {num_heads} (e.g. --tree chain-{num_heads}) or train more heads")
    return tree


def topk_proposal(logits: jax.Array, root: jax.Array, tree: TreeSpec) -> Proposal:
    """Deterministic top-k drafts (`q = None`) of a static tree from per-head logits `[B, K, V]`."""
    topk = jax.lax.top_k(logits, tree.num_ranks)[1].astype(jax.numpy.int32)  # [B, K, R]
    return Proposal(fill_tree_from_topk(root, topk, tree), batched(tree_arrays(tree), root.shape[0]))


def head_metrics(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked mean CE and top-1 / top-5 accuracy of one head: `logits [B, T, V]`, `labels, mask [B, T]`."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    denom = jax.numpy.maximum(mask.sum(), 1.0)
    # The label's rank = how many logits beat it. XLA:CPU lowers `top_k` inside this fusion to a full sort
    # (~40x slower per training step); a comparison count is one pass over the vocabulary.
    rank = (logits > jax.numpy.take_along_axis(logits, labels[..., None], axis=-1)).sum(-1)  # [B, T]
    loss = (ce * mask).sum() / denom
    return loss, {"loss": loss, "top1": ((rank == 0) * mask).sum() / denom,
                  "top5": ((rank < 5) * mask).sum() / denom}


def teacher_ce(logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked mean CE of draft `logits [B, T, V]` against the target's softmax over `teacher_logits [B, T, V]`
    (teacher distillation: Amphista's alignment term, Hydra++'s teacher loss); `mask [B, T]`."""
    teacher = jax.nn.softmax(teacher_logits, axis=-1)
    return (optax.softmax_cross_entropy(logits, teacher) * mask).sum() / jax.numpy.maximum(mask.sum(), 1.0)
