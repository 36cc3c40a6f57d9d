"""Medusa heads (Cai et al., 2024): K independent heads on the target's last hidden state.

Head k (0-based) is `n_layers` ResBlocks `x + SiLU(W x + b)` (W zero-initialised, each layer its own
weights) and a vocab projection initialised from the target's `lm_head`; from the hidden state at position
t it predicts the token at t + 2 + k (the target itself predicts t + 1, the tree's root).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from amphista_jax.drafters.base import (
    DraftContext,
    LogicalInit,
    Proposal,
    head_losses,
    head_projections,
    logical,
    project_heads,
    split_heads,
    topk_proposal,
)
from amphista_jax.models.llama import Output
from amphista_jax.target import Target
from amphista_jax.trees import Tree


@dataclasses.dataclass(frozen=True)
class Medusa(LogicalInit):
    name = "medusa"
    num_heads: int = 4
    num_layers: int = 1
    loss_decay: float = 0.8  # head k's loss weight is loss_decay ** k

    def init_boxed(self, rng: jax.Array, target: Target) -> dict:
        d = target.config.hidden_size
        k, n = self.num_heads, self.num_layers
        return {
            "w": logical(jnp.zeros((k, n, d, d), jnp.float32), None, None, "embed", "mlp"),
            "b": logical(jnp.zeros((k, n, d), jnp.float32), None, None, "mlp"),
            "lm_head": head_projections(target, k),
        }

    def head_logits(self, params: dict, hidden: jax.Array, heads: int | None = None) -> jax.Array:
        """`hidden [..., D]` -> fp32 logits `[..., heads, V]` of the first `heads` heads (default: all); a shallow
        tree needs only its depth's heads, and each head's vocabulary projection is the costly part."""
        k = self.num_heads
        x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (k, hidden.shape[-1]))
        x = x.astype(params["w"].dtype)
        for layer in range(self.num_layers):
            w, b = params["w"][:, layer], params["b"][:, layer]  # [K, D, D], [K, D]
            x = x + jax.nn.silu(jnp.einsum("...KD,KDE->...KE", x, w) + b)
        return project_heads(x, params["lm_head"], heads or k).astype(jnp.float32)

    @property
    def max_depth(self) -> int:
        """Head k drafts depth k + 1."""
        return self.num_heads

    def decode_params(self, params: dict) -> dict:
        return split_heads(params)

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        self.check_tree(tree, target.config.vocab_size)
        return topk_proposal(self.head_logits(params, ctx.hidden, heads=max(tree.depth, 1)), ctx.root, tree)

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output) -> tuple[jax.Array, dict]:
        """Per-head CE against the ground truth, weighted `loss_decay ** k`.

        batch: `tokens [B, T]`, `loss_mask [B, T]` (1 where a token is a training target).
        """
        logits = self.head_logits(params, target_out.hidden)  # [B, T, K, V]
        return head_losses(logits, batch, [self.loss_decay**k for k in range(self.num_heads)])
