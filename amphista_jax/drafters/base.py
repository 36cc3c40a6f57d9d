"""The draft-method contract (DESIGN section 3): pure functions over pytrees, so that the decode loop and
the trainer never branch on a method's name.

A drafter is a frozen (hashable) dataclass of its static settings, with these methods (`target` is the
frozen model: `Target(config, params)`, whose config is static under `jax.jit`):

* `init(rng, target) -> params`. The built-in drafters define `init_boxed` instead (`LogicalInit`): the same
  params with every leaf naming its logical axes, which `draft_param_shapes` reads to shard them like the target.
* `init_state(target_config, batch, cache_size) -> state`: the method's own caches (zeros) or `()`.
* optional `prefill_extras(params, target, prompt [B, T], lengths [B]) -> Extras | None`: extra queries
  that ride along the target's prefill forward (a method without it adds none).
* `prefill(params, target, prompt: PrefillContext, state) -> state`: run the method's own layers
  over the prompt (Amphista's staged adaptation layers fill their caches here).
* `propose(params, target, ctx, tree, rng) -> Proposal`: the tree's `N` node tokens and the tree itself as
  per-row device data (`TreeArrays [B, ...]`). `tree` is the static `TreeSpec` (a preset, JSON or searched
  tree: the drafter fills it) or a `TreeBudget` (a drafter that grows its own tree every step stays inside
  it); both are static under `jax.jit`. The proposal may carry `extras`: extra queries for the verify forward.
* optional `num_extras(tree) -> int`: how many extras every proposal on `tree` carries (a method without it
  adds none); callers size the cache with it (`decode.scratch_slots`) and `spec_init` checks it.
* `commit(params, target, proposal, verdict, verify_out, state) -> (state, next_hidden)`: catch the
  method's caches up with the accepted tokens (the path `verdict.accepted_nodes` of `proposal.tokens`, then
  `verdict.bonus`; `verify_out.hidden [B, N + E, D]` holds the tree's nodes, then the extras') and choose
  the hidden state `[B, D]` the next proposal starts from (usually the target's at the last accepted node:
  `accepted_hidden`).
* optional `decode_params(params) -> params`: the layout `propose` and `commit` read, made once per
  generation before the decode loop (`split_heads`: stacked per-head weights as one array per head).
* `loss(params, target, batch, target_out) -> (loss, metrics)`: the training objective. `batch` holds
  `tokens [B, T]` and `loss_mask [B, T]`; in a train step (never in evaluation) also `rng`, a key for
  training-time randomness (Hydra's embedding noise). `target_out` is the frozen target's stop-gradient
  output over the batch, or None when the drafter sets
* optional `loss_runs_target = True`: its loss runs the target itself (BiTA's masks ride in the target's own
  forward), so gradients flow through the frozen target's activations into the draft params.
* optional `paper_tree`: the name of the tree its paper drafts (`trees.get_tree`), used where no tree is named
  or searched (`--tree auto` without a search, `amphista-jax plan`); default `trees.PAPER_TREE`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import PartitionSpec

from amphista_jax.cache import KVCache
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output, PrefixKV, Transformer, input_embeddings, output_projection
from amphista_jax.trees import (
    Tree,
    TreeArrays,
    TreeError,
    TreeSpec,
    batched,
    fill_tree_from_topk,
    tree_arrays,
    tree_levels,
)
from amphista_jax.verify import Verdict, last_accepted_node


@struct.dataclass
class Target:
    """The frozen target model a drafter works on: its (static) config and its params. Drafters reach the
    model only through these methods, never by indexing `params`."""

    config: ModelConfig = struct.field(pytree_node=False)
    params: dict

    def embed(self, tokens: jax.Array) -> jax.Array:
        """fp32 input embeddings `[..., D]` of `tokens [...]`."""
        return input_embeddings(self.params, tokens).astype(jax.numpy.float32)

    def lm_head(self) -> jax.Array:
        """The fp32 `[D, V]` vocabulary projection (tied embeddings: the embedding transposed)."""
        return output_projection(self.params).astype(jax.numpy.float32)


@struct.dataclass
class DraftContext:
    hidden: jax.Array  # [B, D] target's last-layer hidden state at the node that produced `root`
    root: jax.Array  # [B] the target's own next token (tree node 0)
    lengths: jax.Array  # [B] committed tokens; the root sits at position `lengths`
    state: Any  # the method's own state


@struct.dataclass
class Extras:
    """Extra queries a drafter adds to a target forward (BiTA's mask tokens), given as input embeddings.

    They see the committed prefix, the forward's new tokens they are given (`sees_new`: the tree's nodes at
    verification, the prompt's slots at prefill) and each other (`sees_extras`), plus optional per-layer
    prefix keys/values that nothing else sees. The new tokens never see them, and their keys/values are never
    committed to the cache. Their hidden states follow the new tokens' in the forward's output.
    """

    embeds: jax.Array  # [B, E, D]
    positions: jax.Array  # [B, E]
    sees_new: jax.Array  # [B, E, T] bool
    sees_extras: jax.Array  # [B, E, E] bool
    prefix_k: jax.Array | None = None  # [L, B, Pk, KVH, Dh]
    prefix_v: jax.Array | None = None  # [L, B, Pk, KVH, Dh]

    @property
    def count(self) -> int:
        return self.embeds.shape[1]


def forward(model: Transformer, params: dict, tokens: jax.Array, positions: jax.Array, cache: KVCache | None,
            new_mask: jax.Array, extras: Extras | None, return_logits: bool = True) -> Output:
    """The target over `tokens [B, T]` at `positions [B, T]` with visibility `new_mask [B, T, T]` among them, plus
    a drafter's `extras` after them: the output's hidden states (and logits) are `[B, T + E, ...]`, the new
    tokens' first. The tokens never see the extras; the extras see the committed prefix, `extras.sees_new`,
    `extras.sees_extras` and their own prefix keys/values. Decoding's forwards (`decode.prefill`, verification)
    and a loss that runs the target with extras (BiTA's, without a cache) share it."""
    if extras is None:
        return model.apply({"params": params}, tokens, positions, cache, new_mask, return_logits)
    b, t = tokens.shape
    e = extras.count
    mask = jnp.concatenate([jnp.concatenate([new_mask, jnp.zeros((b, t, e), bool)], 2),
                            jnp.concatenate([extras.sees_new, extras.sees_extras], 2)], 1)  # [B, T + E, T + E]
    prefix = None
    if extras.prefix_k is not None:
        visible = jnp.broadcast_to((jnp.arange(t + e) >= t)[None, :, None], (b, t + e, extras.prefix_k.shape[2]))
        prefix = PrefixKV(extras.prefix_k, extras.prefix_v, visible)
    return model.apply({"params": params}, tokens, jnp.concatenate([positions, extras.positions], 1), cache, mask,
                       return_logits, extras.embeds, prefix)


@struct.dataclass
class PrefillContext:
    out: Output  # the target over the padded prompt slots [B, T, D], then the prefill extras' [B, E, D] if any
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
    extras: Extras | None = None  # extra queries for the verify forward (seen by no tree node, never committed)


def logical(value: jax.Array, *names: str | None) -> nn.Partitioned:
    """`value` boxed with the logical axis names of its dimensions (`sharding.LOGICAL_RULES` maps them)."""
    return nn.Partitioned(value, names)


def head_projections(target: Target, num_heads: int) -> nn.Partitioned:
    """`[K, D, V]` one vocabulary projection per head, each initialised from the target's `lm_head`."""
    lm_head = target.lm_head()
    return logical(jax.numpy.broadcast_to(lm_head, (num_heads,) + lm_head.shape).copy(), None, "embed", "vocab")


class LogicalInit:
    """For drafters that define `init_boxed(rng, target)`: their params with each leaf an `nn.Partitioned` naming
    its logical axes (flax nets through `nn.with_logical_partitioning`, the drafter's own arrays through
    `logical`); a leaf left plain is replicated. `init` is that tree unboxed."""

    def init(self, rng: jax.Array, target: Target) -> Any:
        return nn.unbox(self.init_boxed(rng, target))  # type: ignore[attr-defined]


def draft_param_shapes(drafter: Any, target: Target) -> tuple[Any, Any]:
    """(`jax.ShapeDtypeStruct` tree, logical-axis `PartitionSpec` tree) of `drafter.init`'s params, without
    allocating (like `llama.param_shapes`). A drafter without `init_boxed` has every parameter replicated."""
    key = jax.random.key(0)
    if not hasattr(drafter, "init_boxed"):
        shapes = jax.eval_shape(drafter.init, key, target)
        return shapes, jax.tree.map(lambda _: PartitionSpec(), shapes)
    boxed = jax.eval_shape(drafter.init_boxed, key, target)
    return nn.unbox(boxed), nn.get_partition_spec(boxed)


class Drafter(Protocol):
    def init(self, rng: jax.Array, target: Target) -> Any: ...

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> Any: ...

    def prefill(self, params: Any, target: Target, prompt: PrefillContext, state: Any) -> Any: ...

    def propose(self, params: Any, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal: ...

    def commit(self, params: Any, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: Any) -> tuple[Any, jax.Array]: ...

    def loss(self, params: Any, target: Target, batch: dict, target_out: Output | None) -> tuple[jax.Array, dict]: ...


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


def split_heads(params: dict, names: Sequence[str] = ("lm_head",)) -> dict:
    """The decode-time layout of stacked per-head weights: each `params[name] [K, ...]` as a tuple of K arrays.

    Called once before the decode loop. A head's slice of a stacked weight is a copy under XLA:CPU, made on
    every step inside the loop (0.33 ms a step for two of Medusa's 4096 x 128 fp32 vocabulary projections, a
    decoding step of the embedded model being ~1.3 ms); separate arrays are read in place."""
    return params | {n: tuple(params[n][i] for i in range(params[n].shape[0])) for n in names
                     if n in params and not isinstance(params[n], tuple)}


def project_heads(x: jax.Array, weights: jax.Array | Sequence[jax.Array], heads: int) -> jax.Array:
    """Per-head projections of the first `heads` heads: `x [..., >= heads, D]` and `weights` `[K, D, F]` (stacked)
    or K arrays `[D, F]` (`split_heads`) -> `[..., heads, F]`. One matrix product per head: XLA:CPU runs a
    batched product over heads several times slower than separate ones once a head has more than one row."""
    return jax.numpy.stack([x[..., i, :] @ weights[i] for i in range(heads)], axis=-2)


def draft_by_levels(root: jax.Array, tree: TreeSpec, state: Any, logits: Callable[[int, Any], jax.Array],
                    extend: Callable[[int, Any, jax.Array], Any]) -> Proposal:
    """Deterministic top-k drafts (`q = None`) of a static tree, depth by depth, each node's children from its own
    path (Hydra, the semi-autoregressive drafter). `state` describes the nodes that have children at the current
    depth (leaves `[B, M, ...]`; at depth 0 the root alone), `logits(depth, state) -> [B, M, V]` drafts their
    children, and `extend(depth, parents' state, tokens [B, E])` gives the state of the children that have
    children in turn."""
    b = root.shape[0]
    tokens = jax.numpy.zeros((b, tree.num_nodes), jax.numpy.int32).at[:, 0].set(root)
    for depth, level in enumerate(tree_levels(tree)):
        top = jax.lax.top_k(logits(depth, state), int(level.rank.max()) + 1)[1].astype(jax.numpy.int32)  # [B, M, k]
        children = top[:, level.parent_slot, level.rank]  # [B, C]
        tokens = tokens.at[:, level.nodes].set(children)
        if len(level.expand):
            slots = level.parent_slot[level.expand]
            state = extend(depth, jax.tree.map(lambda x, slots=slots: x[:, slots], state), children[:, level.expand])
    return Proposal(tokens, batched(tree_arrays(tree), b))


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


def head_losses(logits: jax.Array, batch: dict, lm_weights: Sequence[float], teacher_logits: jax.Array | None = None,
                teacher_weight: float = 0.0, teacher_name: str = "teacher") -> tuple[jax.Array, dict[str, jax.Array]]:
    """The draft-head objective every head method shares: head k (0-based) at position t drafts token
    t + 2 + k, which the target predicts at t + 1 + k. `logits [B, T, K, V]`; `batch` holds `tokens` and
    `loss_mask [B, T]`. Returns the sum over heads of `lm_weights[k] * CE(truth)` (+ `teacher_weight *
    CE(softmax(teacher_logits))` when the target's `teacher_logits [B, T, V]` are given) and per-head
    metrics: `head{k}/loss`, `top1`, `top5` and `head{k}/<teacher_name>`."""
    tokens, mask = batch["tokens"], batch["loss_mask"].astype(jax.numpy.float32)
    t = tokens.shape[1]
    total, metrics = 0.0, {}
    for k in range(logits.shape[2]):
        shift = k + 2
        lk, m = logits[:, : t - shift, k], mask[:, shift:]
        lm, head = head_metrics(lk, tokens[:, shift:], m)
        total = total + lm_weights[k] * lm
        metrics |= {f"head{k}/{name}": v for name, v in head.items()}
        if teacher_logits is not None:
            teacher = teacher_ce(lk, teacher_logits[:, shift - 1: t - 1], m)
            total = total + teacher_weight * teacher
            metrics[f"head{k}/{teacher_name}"] = teacher
    return total, metrics


def teacher_ce(logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked mean CE of draft `logits [B, T, V]` against the target's softmax over `teacher_logits [B, T, V]`
    (teacher distillation: Amphista's alignment term, Hydra++'s teacher loss); `mask [B, T]`."""
    teacher = jax.nn.softmax(teacher_logits, axis=-1)
    return (optax.softmax_cross_entropy(logits, teacher) * mask).sum() / jax.numpy.maximum(mask.sum(), 1.0)
