"""Medusa heads (Cai et al., 2024): K independent heads on the target's last hidden state.

Head k (0-based) is `n_layers` ResBlocks `x + SiLU(W x + b)` (W zero-initialised, each layer its own
weights) and a vocab projection initialised from the target's `lm_head`; from the hidden state at position
t it predicts the token at t + 2 + k (the target itself predicts t + 1, the tree's root).

`shared_lm_head=True` (not the paper's form) sends every head through the target's frozen `lm_head` instead of
its own `[D, V]` copy, as EAGLE does: the heads are then `K x n x D x D` whatever the vocabulary (4 heads for a
49152-token, D=576 target: 1.3M parameters instead of 114M). `draft_vocab` (`draft_vocab.py`) cuts either
projection to the draft vocabulary's columns.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from amphista_jax.drafters.base import (
    DraftContext,
    Drafter,
    LogicalInit,
    Projection,
    Proposal,
    head_projections,
    logical,
    project_heads,
    split_heads,
    topk_proposal,
)
from amphista_jax.drafters.draft_vocab import check_fits, normalise_field, project_columns
from amphista_jax.drafters.losses import head_losses
from amphista_jax.infra.ranges import setting
from amphista_jax.models.llama import Output
from amphista_jax.models.target import Target
from amphista_jax.trees.tree import Tree


@Drafter.register
@dataclasses.dataclass(frozen=True)
class Medusa(LogicalInit):
    name = "medusa"
    num_heads: int = setting(4, ge=1)
    num_layers: int = setting(1, ge=0, why="ResBlocks per head")
    loss_decay: float = setting(0.8, gt=0, le=1)  # head k's loss weight is loss_decay ** k
    shared_lm_head: bool = False  # True: every head reads the target's frozen lm_head (no [D, V] of its own)
    draft_vocab: tuple[int, ...] = ()  # the candidates' target ids (draft_vocab.py); () = the whole vocabulary

    def __post_init__(self) -> None:
        super().__post_init__()
        normalise_field(self)

    def init_boxed(self, rng: jax.Array, target: Target) -> dict:
        d = target.config.hidden_size
        k, n = self.num_heads, self.num_layers
        check_fits(self.draft_vocab, target.config.vocab_size)
        params = {"w": logical(jnp.zeros((k, n, d, d), jnp.float32), None, None, "embed", "mlp"),
                  "b": logical(jnp.zeros((k, n, d), jnp.float32), None, None, "mlp")}
        return params if self.shared_lm_head else params | {"lm_head": head_projections(target, k, self.draft_vocab)}

    def projection(self, params: dict, target: Target) -> Projection:
        """The heads' vocabulary projection: their own (`[K, D, V_d]`, or K arrays after `split_heads`), or the
        target's shared `[D, V_d]`."""
        if self.shared_lm_head:
            return project_columns(target.lm_head(), self.draft_vocab)
        return params["lm_head"]

    def head_logits(self, params: dict, target: Target, hidden: jax.Array, heads: int | None = None) -> jax.Array:
        """`hidden [..., D]` -> fp32 logits `[..., heads, V_d]` of the first `heads` heads (default: all); a
        shallow tree needs only its depth's heads, and each head's vocabulary projection is the costly part."""
        k = self.num_heads
        x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (k, hidden.shape[-1]))
        x = x.astype(params["w"].dtype)
        for layer in range(self.num_layers):
            w, b = params["w"][:, layer], params["b"][:, layer]  # [K, D, D], [K, D]
            x = x + jax.nn.silu(jnp.einsum("...KD,KDE->...KE", x, w) + b)
        return project_heads(x, self.projection(params, target), heads or k).astype(jnp.float32)

    @property
    def max_depth(self) -> int:
        """Head k drafts depth k + 1."""
        return self.num_heads

    def decode_params(self, params: dict, target: Target) -> dict:
        return split_heads(params)

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        logits = self.head_logits(params, target, ctx.hidden, heads=max(tree.depth, 1))  # [B, depth, V_d]
        return topk_proposal(logits, ctx.root, tree, self.draft_vocab)

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output) -> tuple[jax.Array, dict]:
        """Per-head CE against the ground truth, weighted `loss_decay ** k`.

        batch: `tokens [B, T]`, `loss_mask [B, T]` (1 where a token is a training target).
        """
        logits = self.head_logits(params, target, target_out.hidden)  # [B, T, K, V_d]
        return head_losses(logits, batch, [self.loss_decay**k for k in range(self.num_heads)],
                           draft_vocab=self.draft_vocab)
