"""Amphista (Li et al., 2024): staged adaptation layers + a bi-directional auto-embedding block.

From the target's last hidden state `h_t` and the embedding `e_{t+1}` of the token the target sampled from
it, drafting runs in one parallel pass ("Amphista: Bi-directional Multi-head Decoding for Accelerating LLM
Inference", section 3):

* staged adaptation (Eq. 1): `h^s_t = SAL^s(fc^s([h^{s-1}_t ; e_{t+1}]), kv^s_{1:t-1})`, `h^0 = h`. Each
  stage is one causal decoder layer of the target's block type with its own KV cache over every committed
  position; head k reads stage `k * S // K` (with two stages: the first half of the heads reads `h^1`, the
  second half `h^2`).
* auto-embedding (Eq. 2-6): head MLPs (`x + SiLU(W x + b)`, W zero-initialised) give K position-aware
  states `[K, D]`; a learnable positional embedding `PE [K, D]` is added and one or more bi-directional
  (unmasked) self-attention layers mix the heads; per-head LM heads (full `[D, V]` initialised from the
  target's `lm_head`, or low-rank `[D, r] x [r, V]` initialised from its truncated SVD, appendix A.2.5)
  give the logits. Head k (0-based) at position t drafts the token at t + 2 + k.
* loss (Eq. 7-9): `lambda_alignment * CE(draft, softmax(target logits))` + `lambda_lm * CE(draft, truth)`.

Ablations (paper Tables 4-5, appendix A.2.3-A.2.5) are settings: `staged_adaptation=False` (heads read
`h_t`; the sampled token is then unused), `adaptation_stages=1` (one adaptation layer for all heads; 1-4),
`sampled_token=False` (`fc^s` sees `h^{s-1}` only), `auto_embedding=False` (no PE, no attention: each head
maps its own state to logits), `positional_encoding=False`, `auto_embedding_layers=2` (Amphista-alpha),
`lm_head_rank=r`.

Decoding keeps the invariant: the adaptation caches hold the pairs `(h_t, e_{t+1})` of every committed
position `t < lengths - 1` plus the pair of the last one, whose adapted states (`adapted [B, S, D]`) the
next proposal reads. `prefill` runs the prompt; `commit` runs the accepted path's pairs (fixed `D + 1`
slots, masked by the accepted count), so `propose` only runs the heads.

`draft_vocab` (`draft_vocab.py`): the LM heads cover only the draft vocabulary's columns (the low-rank ones start
from the SVD of the target's `lm_head` cut to those columns).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from amphista_jax.drafters.base import (
    DraftContext,
    Drafter,
    LogicalInit,
    PrefillContext,
    Proposal,
    accepted_hidden,
    accepted_tokens,
    head_projections,
    logical,
    project_heads,
    split_heads,
    topk_proposal,
)
from amphista_jax.drafters.causal_layers import at_last, block_config, layer_caches, path_hidden, run_and_commit
from amphista_jax.drafters.draft_vocab import normalise_field, project_columns
from amphista_jax.drafters.losses import check_loss_weights, head_losses
from amphista_jax.infra.ranges import setting
from amphista_jax.models.cache import KVCache
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output, decoder_stack, run_stack
from amphista_jax.models.projections import logical_dense
from amphista_jax.models.target import Target
from amphista_jax.trees.tree import Tree
from amphista_jax.trees.verify import Verdict

MAX_STAGES = 4


@Drafter.register
@dataclasses.dataclass(frozen=True)
class Amphista(LogicalInit):
    lm_setting = "lambda_lm"
    name = "amphista"
    num_heads: int = setting(4, ge=1)
    # 1 = "one adaptation layer for all heads"; up to 4 (appendix A.2.3), and at most num_heads
    adaptation_stages: int = setting(2, ge=1, le=MAX_STAGES)
    staged_adaptation: bool = True  # False = "w/o staged adaptation"
    sampled_token: bool = True  # False = "w/o sampled token"
    auto_embedding: bool = True  # False = "w/o auto-embedding"
    positional_encoding: bool = True  # False = "w/o position encoding"
    auto_embedding_layers: int = setting(1, ge=1, why="auto_embedding=False removes the block")  # 2: Amphista-alpha
    lm_head_rank: int = setting(0, ge=0, why="0 = full rank")  # the LM heads' rank
    lambda_alignment: float = 1.0  # lambda_1, Eq. 7
    lambda_lm: float = 1.0  # lambda_2, Eq. 7
    draft_vocab: tuple[int, ...] = ()  # the candidates' target ids (draft_vocab.py); () = the whole vocabulary

    def __post_init__(self) -> None:
        super().__post_init__()
        normalise_field(self)
        if self.adaptation_stages > self.num_heads:
            raise ValueError(f"adaptation_stages={self.adaptation_stages} must be in [1, min({MAX_STAGES}, "
                             f"num_heads={self.num_heads})]")
        check_loss_weights(lambda_lm=self.lambda_lm, lambda_alignment=self.lambda_alignment)

    @property
    def stages(self) -> int:
        """Adapted states the heads read: the adaptation stages, or the target's hidden state alone."""
        return self.adaptation_stages if self.staged_adaptation else 1

    def _net(self, target: ModelConfig) -> _AmphistaNet:
        return _AmphistaNet(self, target)

    @property
    def max_depth(self) -> int:
        """Head k drafts depth k + 1."""
        return self.num_heads

    def init_boxed(self, rng: jax.Array, target: Target) -> dict:
        d = target.config.hidden_size
        zeros = jnp.zeros((1, 1, d), jnp.float32)
        params = self._net(target.config).init(rng, zeros, zeros, jnp.zeros((1, 1), jnp.int32))["params"]
        k = self.num_heads
        if self.lm_head_rank:
            lm_head = project_columns(target.lm_head(), self.draft_vocab)  # [D, V_d]
            u, s, vt = jnp.linalg.svd(lm_head, full_matrices=False)
            r, v = self.lm_head_rank, lm_head.shape[1]
            root = jnp.sqrt(s[:r])
            return params | {"lm_a": logical(jnp.broadcast_to(u[:, :r] * root, (k, d, r)).copy(), None, "embed", None),
                             "lm_b": logical(jnp.broadcast_to(root[:, None] * vt[:r], (k, r, v)).copy(), None, None,
                                             "vocab")}
        return params | {"lm_head": head_projections(target, k, self.draft_vocab)}

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> dict:
        d = target_config.hidden_size
        state: dict[str, Any] = {"adapted": jnp.zeros((batch, self.stages, d), jnp.float32)}
        if self.staged_adaptation:
            state["caches"] = layer_caches(target_config, self.adaptation_stages, batch, cache_size)
        return state

    def _adapt_and_cache(self, params: dict, target: Target, hidden: jax.Array, next_tokens: jax.Array,
                         count: jax.Array, state: dict) -> dict:
        """Run the pairs `(hidden [B, T, D], e(next_tokens [B, T]))` at the caches' next positions; commit
        the first `count [B]` and keep the adapted states of pair `count - 1` for the next proposal."""
        if not self.staged_adaptation:
            return {"adapted": at_last(hidden[:, :, None], count)}
        embed = target.embed(next_tokens)

        def run(positions: jax.Array, caches: tuple[KVCache, ...]) -> tuple[jax.Array, tuple[KVCache, ...]]:
            return self._net(target.config).apply({"params": params}, hidden.astype(jnp.float32), embed, positions,
                                                  caches, method=_AmphistaNet.adapt)

        adapted, caches = run_and_commit(run, state["caches"], hidden.shape[1], count)  # [B, S, D]
        return {"adapted": adapted, "caches": caches}

    def prefill(self, params: dict, target: Target, prompt: PrefillContext, state: dict) -> dict:
        # Pair t sees the prompt's token t + 1; the last prompt position sees the root.
        return self._adapt_and_cache(params, target, prompt.out.hidden, prompt.next_tokens(), prompt.lengths, state)

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        logits = self.head_logits(params, target, ctx.state["adapted"], max(tree.depth, 1))  # [B, depth, V_d]
        return topk_proposal(logits, ctx.root, tree, self.draft_vocab)

    def head_logits(self, params: dict, target: Target, adapted: jax.Array, depth: int | None = None) -> jax.Array:
        """Adapted states `[..., S, D]` -> fp32 draft logits `[..., depth, V_d]` of the first `depth` heads
        (default: all; Eq. 2-6)."""
        return self.project(params, self._net(target.config).apply({"params": params}, adapted,
                                                                    method=_AmphistaNet.heads), depth)

    def project(self, params: dict, x: jax.Array, depth: int | None = None) -> jax.Array:
        """Eq. 6, the per-head LM heads (full, or low-rank `lm_a` then `lm_b`): head states `[..., K, D]` ->
        fp32 logits `[..., depth, V_d]` of the first `depth` heads (default: all)."""
        kept = depth or self.num_heads
        if self.lm_head_rank:
            return project_heads(project_heads(x, params["lm_a"], kept), params["lm_b"], kept).astype(jnp.float32)
        return project_heads(x, params["lm_head"], kept).astype(jnp.float32)

    def decode_params(self, params: dict, target: Target) -> dict:
        return split_heads(params, ("lm_head", "lm_a", "lm_b"))

    def commit(self, params: dict, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: dict) -> tuple[dict, jax.Array]:
        state = self._adapt_and_cache(params, target, path_hidden(verdict, verify_out),
                                      accepted_tokens(proposal, verdict), verdict.n_accepted, state)
        return state, accepted_hidden(verdict, verify_out)

    def draft_logits(self, params: dict, target: Target, tokens: jax.Array, hidden: jax.Array) -> jax.Array:
        """Training-time drafts over whole sequences: `tokens [B, T]`, target hidden `[B, T, D]` ->
        `[B, T, K, V_d]` (pair t uses the true token t + 1: teacher forcing; the last position's is a pad)."""
        embed = target.embed(jnp.roll(tokens, -1, axis=1))
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return self.project(params, self._net(target.config).apply({"params": params}, hidden.astype(jnp.float32),
                                                                    embed, positions))

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output) -> tuple[jax.Array, dict]:
        """Eq. 7-9 summed over heads. batch: `tokens [B, T]`, `loss_mask [B, T]`; `target_out` needs logits."""
        logits = self.draft_logits(params, target, batch["tokens"], target_out.hidden)  # [B, T, K, V_d]
        return head_losses(logits, batch, [self.lambda_lm] * self.num_heads, target_out.logits,
                           self.lambda_alignment, teacher_name="alignment", draft_vocab=self.draft_vocab)


class _AmphistaNet(nn.Module):
    spec: Amphista
    target: ModelConfig

    def setup(self) -> None:
        s, d, k = self.spec, self.target.hidden_size, self.spec.num_heads
        if s.staged_adaptation:
            self.fc = [logical_dense(d, ("embed", "mlp"), f"fc{i}") for i in range(s.adaptation_stages)]
            self.sal = [decoder_stack(block_config(self.target, 1), jnp.float32, "xla", name=f"sal{i}")
                        for i in range(s.adaptation_stages)]
        zeros = nn.initializers.zeros_init()
        self.head_w = self.param("head_w", nn.with_logical_partitioning(zeros, (None, "embed", "mlp")), (k, d, d))
        self.head_b = self.param("head_b", nn.with_logical_partitioning(zeros, (None, "mlp")), (k, d))
        if s.auto_embedding:
            if s.positional_encoding:
                self.pe = self.param("pe", nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, "embed")),
                                     (k, d))
            self.encoder = decoder_stack(block_config(self.target, s.auto_embedding_layers), jnp.float32, "xla",
                                         name="auto_embedding")

    def __call__(self, hidden: jax.Array, next_embed: jax.Array, positions: jax.Array) -> jax.Array:
        """Whole sequences without caches (training, init): `[B, T, D]` x2, `[B, T]` -> head states
        `[B, T, K, D]`."""
        adapted, _ = self.adapt(hidden, next_embed, positions, None)
        return self.heads(adapted)

    def adapt(self, hidden: jax.Array, next_embed: jax.Array, positions: jax.Array,
              caches: tuple[KVCache, ...] | None) -> tuple[jax.Array, tuple[KVCache, ...] | None]:
        """Eq. 1, causal over the T pairs after each cache's committed prefix: -> (`[B, T, S, D]`, caches)."""
        if not self.spec.staged_adaptation:
            return hidden[:, :, None], caches
        x, outs, written = hidden, [], []
        for i in range(self.spec.adaptation_stages):
            inp = jnp.concatenate([x, next_embed], axis=-1) if self.spec.sampled_token else x
            x, cache = run_stack(self.sal[i], block_config(self.target, 1), self.fc[i](inp), positions,
                                 None if caches is None else caches[i], None)
            outs.append(x)
            written.append(cache)
        return jnp.stack(outs, axis=-2), None if caches is None else tuple(written)

    def heads(self, adapted: jax.Array) -> jax.Array:
        """Eq. 2-5: adapted states `[..., S, D]` -> the K heads' states `[..., K, D]` (every head sees every head
        in the block); `Amphista.project` applies the LM heads (Eq. 6)."""
        s, k = self.spec, self.spec.num_heads
        x = adapted[..., jnp.asarray([i * s.stages // k for i in range(k)]), :]  # [..., K, D] head -> its stage
        x = x + nn.silu(jnp.einsum("...KD,KDE->...KE", x, self.head_w) + self.head_b)
        if s.auto_embedding:
            if s.positional_encoding:
                x = x + self.pe
            flat = x.reshape((-1, k, x.shape[-1]))  # [n, K, D]
            n = flat.shape[0]
            # Bi-directional: every head sees every head; position 0 everywhere makes RoPE the identity, so
            # head order reaches the block only through PE.
            flat, _ = run_stack(self.encoder, block_config(self.target, s.auto_embedding_layers), flat,
                                jnp.zeros((n, k), jnp.int32), None, jnp.ones((n, k, k), bool))
            x = flat.reshape(x.shape)
        return x
