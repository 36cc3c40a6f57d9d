"""Medusa heads (Cai et al., 2024): K independent heads on the target's last hidden state.

Head k (0-based) is `n_layers` ResBlocks `x + SiLU(W x + b)` (W zero-initialised, each layer its own
weights) and a vocab projection initialised from the target's `lm_head`; from the hidden state at position
t it predicts the token at t + 2 + k (the target itself predicts t + 1, the tree's root).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from amphista_jax.drafters.base import DraftContext, Proposal, accepted_hidden, fill_tree_from_topk
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output
from amphista_jax.trees import TreeArrays
from amphista_jax.verify import Verdict


def target_lm_head(target_params: dict) -> jax.Array:
    """The target's `[D, V]` output projection (the transposed embedding when tied)."""
    if "lm_head" in target_params:
        return target_params["lm_head"]["kernel"]
    return target_params["embed"]["embedding"].T


@dataclasses.dataclass(frozen=True)
class Medusa:
    num_heads: int = 4
    num_layers: int = 1
    loss_decay: float = 0.8  # head k's loss weight is loss_decay ** k

    def init(self, rng: jax.Array, target_config: ModelConfig, target_params: dict) -> dict:
        d = target_config.hidden_size
        k, n = self.num_heads, self.num_layers
        lm_head = target_lm_head(target_params).astype(jnp.float32)
        return {
            "w": jnp.zeros((k, n, d, d), jnp.float32),
            "b": jnp.zeros((k, n, d), jnp.float32),
            "lm_head": jnp.broadcast_to(lm_head, (k,) + lm_head.shape).copy(),
        }

    def head_logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """`hidden [..., D]` -> fp32 logits `[..., K, V]` of every head."""
        x = jnp.broadcast_to(hidden[..., None, :], hidden.shape[:-1] + (self.num_heads, hidden.shape[-1]))
        x = x.astype(params["w"].dtype)
        for layer in range(self.num_layers):
            w, b = params["w"][:, layer], params["b"][:, layer]  # [K, D, D], [K, D]
            x = x + jax.nn.silu(jnp.einsum("...KD,KDE->...KE", x, w) + b)
        return jnp.einsum("...KD,KDV->...KV", x, params["lm_head"]).astype(jnp.float32)

    def init_state(self, batch: int, cache_size: int) -> tuple:
        return ()

    def prefill(self, params, target_params, target_out: Output, prompt_lengths, state) -> tuple:
        return state

    def propose(self, params: dict, target_params: dict, ctx: DraftContext, tree: TreeArrays,
                rng: jax.Array) -> Proposal:
        depth = int(np.asarray(tree.depth).max())
        if depth > self.num_heads:
            raise ValueError(f"tree depth {depth} needs {depth} heads but these Medusa heads have "
                             f"{self.num_heads=}: pick a tree of depth <= {self.num_heads} (e.g. --tree chain-"
                             f"{self.num_heads}) or train more heads")
        logits = self.head_logits(params, ctx.hidden)  # [B, K, V]
        k = int(np.asarray(tree.topk_index).max()) + 1  # widest rank any head must supply
        topk = jax.lax.top_k(logits, k)[1].astype(jnp.int32)  # [B, K, k]
        return Proposal(fill_tree_from_topk(ctx.root, topk, tree))

    def commit(self, params, target_params, verdict: Verdict, verify_out: Output, state) -> tuple:
        return state, accepted_hidden(verdict, verify_out)

    def loss(self, params: dict, target_params: dict, batch: dict, target_out: Output) -> tuple[jax.Array, dict]:
        """Per-head CE against the ground truth, weighted `loss_decay ** k`.

        batch: `tokens [B, T]`, `loss_mask [B, T]` (1 where a token is a training target).
        """
        tokens, mask = batch["tokens"], batch["loss_mask"].astype(jnp.float32)
        logits = self.head_logits(params, target_out.hidden)  # [B, T, K, V]
        total, metrics = 0.0, {}
        t = tokens.shape[1]
        for k in range(self.num_heads):
            shift = k + 2
            labels, m = tokens[:, shift:], mask[:, shift:]  # [B, T - shift]
            lk = logits[:, : t - shift, k]
            ce = optax.softmax_cross_entropy_with_integer_labels(lk, labels)
            denom = jnp.maximum(m.sum(), 1.0)
            total = total + self.loss_decay**k * (ce * m).sum() / denom
            top5 = jax.lax.top_k(lk, 5)[1]
            metrics[f"head{k}/loss"] = (ce * m).sum() / denom
            metrics[f"head{k}/top1"] = ((top5[..., 0] == labels) * m).sum() / denom
            metrics[f"head{k}/top5"] = ((top5 == labels[..., None]).any(-1) * m).sum() / denom
        return total, metrics
