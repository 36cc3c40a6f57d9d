"""Hydra and Hydra++ (Ankner et al., 2024): sequentially dependent draft heads.

Head i (1-based, i = 1..K) drafts the token i steps past the root from the base state and the input
embeddings of the candidate path so far ("Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding", section 3)::

    p(x_{t+i} | ...) = f_i([h ; E(x_root) ; E(x_1) ; ... ; E(x_{i-1})])        # width (i + 1) D

`f_i` is an MLP whose first layer maps that width to D with a learned linear on the residual path
(`skip(x) + SiLU(W x + b)`, initialised to pass `h` through with W zero, so fresh Hydra heads start as
the target's `lm_head`; Hydra++'s base state first goes through its randomly initialised prefix layer),
then `num_layers - 1` ResBlocks `x + SiLU(W x + b)`, then a per-head vocab projection initialised from
the target's `lm_head`. Every layer has its own weights.

Drafting walks the tree depth by depth with fixed shapes: at depth i the head runs once on every node of
depth i - 1 that has children (batched over those nodes), each on its own path's embeddings, and the
children take that node's top-k. So siblings' subtrees differ (Medusa's are copies of each other).

Hydra++ (section 3.1, appendix A) is a set of settings: `num_layers=4`, the teacher loss (CE against the
target's softmax; `teacher_weight=1, lm_weight=0`), and `prefix_layer=True`: one extra causal decoder layer
of the target's block type (plus a final RMSNorm, as the reference's one-layer `LlamaModel`) over the
target's hidden states, with its own KV cache kept in sync by `prefill` / `commit` (`causal_layers.py`);
its output at the last committed position replaces `h` as the heads' base state, so it runs once per step.
`alpha_noise > 0` adds NEFTune noise `Uniform(-1, 1) * alpha / sqrt(T D)` to the heads' input embeddings
in training (appendix A.1; the paper found it hurts and uses 0; the reference code adds it there).

Training is teacher-forced: head k (0-based) at position t reads the true tokens t + 1 .. t + 1 + k as its
path and drafts token t + 2 + k; its teacher is the target's distribution at t + 1 + k.

`draft_vocab` (`draft_vocab.py`): the heads' projections cover only the draft vocabulary's columns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.drafters.base import (
    DraftContext,
    Drafter,
    LogicalInit,
    PrefillContext,
    Proposal,
    accepted_hidden,
    draft_by_levels,
    head_projections,
    project_heads,
    split_heads,
)
from amphista_jax.drafters.causal_layers import block_config, layer_caches, path_hidden, run_and_commit
from amphista_jax.drafters.draft_vocab import normalise_field
from amphista_jax.drafters.losses import check_loss_weights, head_losses
from amphista_jax.infra.ranges import setting
from amphista_jax.models.cache import KVCache
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output, RMSNorm, decoder_stack, run_stack
from amphista_jax.models.projections import logical_dense
from amphista_jax.models.target import Target
from amphista_jax.trees.tree import Tree
from amphista_jax.trees.verify import Verdict


@Drafter.register
@dataclasses.dataclass(frozen=True)
class Hydra(LogicalInit):
    lm_setting = "lm_weight"
    name = "hydra"
    num_heads: int = setting(4, ge=1)
    # MLP layers per head (Hydra++: 4)
    num_layers: int = setting(1, ge=1, why="the first layer maps the path to the hidden size")
    prefix_layer: bool = False  # Hydra++'s prefix-attention decoder layer
    lm_weight: float = 1.0  # CE against the ground-truth token (Hydra; Hydra++: 0)
    teacher_weight: float = 0.0  # CE against the target's softmax (Hydra++: 1)
    # embedding noise in training (appendix A.1; the paper settles on 0)
    alpha_noise: float = setting(0.0, ge=0, why="0 = no embedding noise")
    draft_vocab: tuple[int, ...] = ()  # the candidates' target ids (draft_vocab.py); () = the whole vocabulary

    def __post_init__(self) -> None:
        super().__post_init__()
        normalise_field(self)
        check_loss_weights(lm_weight=self.lm_weight, teacher_weight=self.teacher_weight)

    @classmethod
    def plus_plus(cls, **overrides: Any) -> Hydra:
        """Hydra++: 4-layer heads, teacher loss, prefix-attention layer."""
        return cls(**({"num_layers": 4, "prefix_layer": True, "lm_weight": 0.0, "teacher_weight": 1.0} | overrides))

    def _net(self, target: ModelConfig) -> _HydraNet:
        return _HydraNet(self, target)

    @property
    def max_depth(self) -> int:
        """Head k drafts depth k + 1."""
        return self.num_heads

    def init_boxed(self, rng: jax.Array, target: Target) -> dict:
        d, k = target.config.hidden_size, self.num_heads
        params = self._net(target.config).init(
            rng, jnp.zeros((1, 1, d)), jnp.zeros((1, 1, k, d)), jnp.zeros((1, 1), jnp.int32))["params"]
        return params | {"lm_head": head_projections(target, k, self.draft_vocab)}

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> dict | tuple:
        if not self.prefix_layer:
            return ()
        return {"prefix": jnp.zeros((batch, target_config.hidden_size), jnp.float32),
                "caches": layer_caches(target_config, 1, batch, cache_size)}

    def _prefix_and_cache(self, params: dict, target: Target, hidden: jax.Array, count: jax.Array,
                          state: dict) -> dict:
        """Run the prefix layer over `hidden [B, T, D]` at its cache's next positions, commit `count [B]`, and
        keep its output at position `count - 1` (the next proposal's base state)."""
        def run(positions: jax.Array, caches: tuple[KVCache, ...]) -> tuple[jax.Array, tuple[KVCache, ...]]:
            out, cache = self._net(target.config).apply({"params": params}, hidden.astype(jnp.float32), positions,
                                                        caches[0], method=_HydraNet.prefix)
            return out, (cache,)

        prefix, caches = run_and_commit(run, state["caches"], hidden.shape[1], count)
        return {"prefix": prefix, "caches": caches}

    def prefill(self, params: dict, target: Target, prompt: PrefillContext, state: Any) -> Any:
        if not self.prefix_layer:
            return state
        return self._prefix_and_cache(params, target, prompt.out.hidden, prompt.lengths, state)

    def commit(self, params: dict, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: Any) -> tuple[Any, jax.Array]:
        if self.prefix_layer:
            state = self._prefix_and_cache(params, target, path_hidden(verdict, verify_out), verdict.n_accepted,
                                           state)
        return state, accepted_hidden(verdict, verify_out)

    def base_state(self, ctx: DraftContext) -> jax.Array:
        """`[B, D]` what the heads read in place of `h`: the prefix layer's output, or the target's hidden."""
        return ctx.state["prefix"] if self.prefix_layer else ctx.hidden

    def head_logits(self, params: dict, target: Target, head: int, base: jax.Array, path: jax.Array) -> jax.Array:
        """Head `head` (0-based) on base states `[..., D]` (broadcast) and path tokens `[..., head + 1]` (the
        root first) -> fp32 logits `[..., V_d]` for the next token."""
        embed = target.embed(path)  # [..., head + 1, D]
        base = jnp.broadcast_to(base.astype(jnp.float32), embed.shape[:-2] + base.shape[-1:])
        x = jnp.concatenate([base, embed.reshape(embed.shape[:-2] + (-1,))], axis=-1)
        return self._logits(params, target, head, x)

    def _logits(self, params: dict, target: Target, head: int, x: jax.Array) -> jax.Array:
        """Head `head` (0-based) on its input `[..., (head + 2) D]` -> fp32 logits `[..., V_d]`: its MLP, then its
        vocabulary projection."""
        mlp = self._net(target.config).apply({"params": params}, head, x, method=_HydraNet.head)
        return (mlp @ params["lm_head"][head]).astype(jnp.float32)

    def decode_params(self, params: dict, target: Target) -> dict:
        return split_heads(params)

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        """Deterministic top-k drafts (`q = None`), depth by depth: each node's children are the top-k of the
        next head applied to that node's own path."""
        # Head inputs of the nodes that have children, depth by depth: [B, M, (depth + 2) D].
        inputs = jnp.concatenate([self.base_state(ctx).astype(jnp.float32), target.embed(ctx.root)], axis=-1)[:, None]
        return draft_by_levels(ctx.root, tree, inputs, lambda depth, x: self._logits(params, target, depth, x),
                               lambda depth, x, children: jnp.concatenate([x, target.embed(children)], axis=-1),
                               self.draft_vocab)

    def draft_logits(self, params: dict, target: Target, tokens: jax.Array, hidden: jax.Array,
                     rng: jax.Array | None = None) -> jax.Array:
        """Training-time drafts over whole sequences, teacher-forced: `tokens [B, T]`, target hidden
        `[B, T, D]` -> `[B, T, K, V_d]` (head k at t reads tokens t + 1 .. t + 1 + k; past the end they wrap
        around and the loss masks them). `rng` adds the embedding noise when `alpha_noise > 0`."""
        embed = target.embed(tokens)  # [B, T, D]
        b, t, d = embed.shape
        if rng is not None and self.alpha_noise > 0:
            embed = embed + jax.random.uniform(rng, embed.shape, minval=-1.0, maxval=1.0) * (
                self.alpha_noise / np.sqrt(t * d))
        path = jnp.stack([jnp.roll(embed, -(j + 1), axis=1) for j in range(self.num_heads)], axis=2)  # [B, T, K, D]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        mlps = self._net(target.config).apply({"params": params}, hidden.astype(jnp.float32), path, positions)
        return project_heads(mlps, params["lm_head"], self.num_heads).astype(jnp.float32)

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output) -> tuple[jax.Array, dict]:
        """Per head, `lm_weight * CE(truth) + teacher_weight * CE(softmax(target))`, summed over heads (the
        reference trainer's sum, no per-head decay). `target_out` needs logits for the teacher term."""
        logits = self.draft_logits(params, target, batch["tokens"], target_out.hidden, batch.get("rng"))  # [B,T,K,Vd]
        return head_losses(logits, batch, [self.lm_weight] * self.num_heads,
                           target_out.logits if self.teacher_weight else None, self.teacher_weight,
                           draft_vocab=self.draft_vocab)


def _pass_first(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """`[(i + 2) D, D]` kernel `[I ; 0]`: the residual path starts as the base state alone."""
    return jnp.eye(shape[0], shape[1], dtype=dtype)


class _HydraMLP(nn.Module):
    """One Hydra head's MLP: `[..., W] -> [..., D]`."""

    num_layers: int
    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        zeros = nn.initializers.zeros_init()
        axes = ("embed", "mlp")
        skip = logical_dense(self.features, axes, "skip", _pass_first)(x)  # learned residual path
        x = skip + nn.silu(logical_dense(self.features, axes, "in", zeros)(x))
        for layer in range(1, self.num_layers):
            x = x + nn.silu(logical_dense(self.features, axes, f"res{layer}", zeros)(x))
        return x


class _HydraNet(nn.Module):
    spec: Hydra
    target: ModelConfig

    def setup(self) -> None:
        s, d = self.spec, self.target.hidden_size
        if s.prefix_layer:
            self.prefix_layer = decoder_stack(block_config(self.target, 1), jnp.float32, "xla", name="prefix")
            self.prefix_norm = RMSNorm(self.target.rms_norm_eps, name="prefix_norm")
        self.mlps = [_HydraMLP(s.num_layers, d, name=f"head{i}") for i in range(s.num_heads)]

    def __call__(self, hidden: jax.Array, path: jax.Array, positions: jax.Array) -> jax.Array:
        """Whole sequences without caches (training, init): hidden `[B, T, D]`, path embeddings
        `[B, T, K, D]` (E of tokens t + 1 .. t + K), positions `[B, T]` -> the heads' MLP outputs `[B, T, K, D]`."""
        base, _ = self.prefix(hidden, positions, None)
        return jnp.stack([self.mlps[i](jnp.concatenate([base, path[:, :, : i + 1].reshape(path.shape[:2] + (-1,))],
                                                       axis=-1))
                          for i in range(self.spec.num_heads)], axis=2)

    def prefix(self, hidden: jax.Array, positions: jax.Array,
               cache: KVCache | None) -> tuple[jax.Array, KVCache | None]:
        """The heads' base states `[B, T, D]`: the prefix layer's (causal over the cache's committed prefix
        and the T new positions), or `hidden` itself without one."""
        if not self.spec.prefix_layer:
            return hidden, cache
        x, cache = run_stack(self.prefix_layer, block_config(self.target, 1), hidden, positions, cache, None)
        return self.prefix_norm(x), cache

    def head(self, i: int, x: jax.Array) -> jax.Array:
        """Head `i`'s MLP (0-based) on its input `[..., (i + 2) D]` -> `[..., D]`."""
        return self.mlps[i](x)
