"""EAGLE (Li et al., 2024) and EAGLE-2's context-aware dynamic draft tree.

EAGLE drafts at the feature level (section 2 of "Gumiho: A Hybrid Architecture to Prioritize Early Tokens in
Speculative Decoding" reviews it): `num_layers` decoder
layers (EAGLE: one; Gumiho's serial part: two) of the target's block type, with their own KV cache, read
`FC([E(x_{t+1}) ; f_t]) -> D` (`f_t` the target's last-layer hidden state at t, after the final norm) and
predict `f_{t+1}`; the target's frozen `lm_head` turns the prediction into the draft distribution of `x_{t+2}`.
Drafting is autoregressive in that feature space: a drafted node's predicted feature is its children's input
feature. Every layer normalises its input before attention; the released EAGLE heads' one layer does not
(`input_norm=False`, what `published.read_eagle` loads them as).

Slot `p` of the drafter's cache holds its input `(E(x_{p+1}), f_p)`; it stays in step with the target's
cache (`causal_layers.py`): `prefill` runs the layers over the prompt (the root is the last slot's next token)
and `commit` over the accepted path (each path node's next token, then the bonus, with the target's features
at those nodes). The output at the last committed slot (`state["base"]`, the prediction of the root's own
feature) gives the root's children. A tree node at depth d then sits at drafter position `lengths + d - 1`
with input `(E(token), predicted feature of its parent)`; each depth's nodes run through the layer in one call
and see the committed cache, their ancestors' entries from earlier calls (kept as scratch keys/values of this
step, `PrefixKV`) and themselves.

Trees:
- a static `TreeSpec` (EAGLE): every node gets the top-k rank the tree gives it among its parent's drafts;
- a `TreeBudget` (EAGLE-2, `trees.growth.dynamic_tree`, built by `trees.growth.grow_dynamic_tree`): the root's top-k
  children by draft log-probability form the first frontier; at each further depth the whole frontier runs
  through the layer in one call, each member proposes its top-k children scored by cumulative
  log-probability, and the global top-k of those become the next frontier, down to `budget.depth`; all
  drafted nodes are then reranked and the best `num_nodes - 1` kept.
Drafts are deterministic top-k (`q = None`).

Training (EAGLE, section 4 of its paper): teacher-forced on the target's own features with uniform noise
`U(-a, a)` (`feature_noise`); `reg_weight * SmoothL1(predicted f_{t+1}, f_{t+1}) + cls_weight *
CE(lm_head(predicted), softmax(target logits at t+1))`, weights 1 and 0.1.

`draft_vocab` (`draft_vocab.py`, EAGLE-3's `d2t`): the frozen `lm_head` is read at the draft vocabulary's columns
only, every top-k over them is mapped back to target ids (`FeatureDrafting.top_k`, the dynamic tree's root), and
the CE term's teacher is the target's distribution restricted to them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from amphista_jax.drafters.base import (
    DraftContext,
    Drafter,
    LogicalInit,
    PrefillContext,
    Proposal,
    accepted_hidden,
    accepted_tokens,
)
from amphista_jax.drafters.causal_layers import block_config, path_hidden, run_and_commit, with_rope_base
from amphista_jax.drafters.draft_vocab import normalise_field, project_columns
from amphista_jax.drafters.feature_drafting import FeatureDrafting
from amphista_jax.drafters.losses import check_loss_weights, head_losses
from amphista_jax.infra.ranges import setting
from amphista_jax.models.cache import KVCache
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output, PrefixKV, decoder_stack, run_stack
from amphista_jax.models.projections import logical_dense
from amphista_jax.models.target import Target
from amphista_jax.trees.tree import Tree, TreeBudget, TreeSpec
from amphista_jax.trees.verify import Verdict


@Drafter.register
@dataclasses.dataclass(frozen=True)
class Eagle(LogicalInit):
    name = "eagle"
    paper_tree = "dynamic"  # EAGLE-2's dynamic tree
    tree_kinds = (TreeSpec, TreeBudget)
    num_layers: int = setting(1, ge=1)  # decoder layers of the draft stack (EAGLE: 1; Gumiho's serial part: 2)
    feature_noise: float = setting(0.1, ge=0, why="0 = no noise")  # training: U(-a, a) added to the target's features
    reg_weight: float = 1.0  # SmoothL1 regression of the next feature
    cls_weight: float = 0.1  # CE of lm_head(predicted feature) against the target's distribution
    draft_vocab: tuple[int, ...] = ()  # the candidates' target ids (draft_vocab.py); () = the whole vocabulary
    input_norm: bool = True  # False: the released heads' form, attention reads the layer's input unnormalised
    # the draft layers' RoPE base; 0: the target's. Released heads keep their own config's (the reference's rule:
    # 10000 where it names none, whatever the target's is)
    rope_theta: float = setting(0.0, ge=0, why="0 = the target's RoPE base")

    def __post_init__(self) -> None:
        super().__post_init__()
        normalise_field(self)
        if not self.input_norm and self.num_layers != 1:
            raise ValueError(f"input_norm=False (EAGLE's released one-layer form) needs num_layers=1, not "
                             f"{self.num_layers}")
        check_loss_weights(reg_weight=self.reg_weight, cls_weight=self.cls_weight)

    @property
    def reads_labels(self) -> bool:
        return False  # the feature regression and the CE to the target's distribution

    def _net(self, target: ModelConfig) -> _EagleNet:
        return _EagleNet(with_rope_base(target, self.rope_theta), self.num_layers, self.input_norm)

    def init_boxed(self, rng: jax.Array, target: Target) -> dict:
        d = target.config.hidden_size
        x = jnp.zeros((1, 1, d))
        return self._net(target.config).init(rng, x, x, jnp.zeros((1, 1), jnp.int32), None)["params"]

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> dict:
        c = target_config
        return {"base": jnp.zeros((batch, c.hidden_size), jnp.float32),
                "caches": (KVCache.zeros(self.num_layers, batch, cache_size, c.num_kv_heads, c.head_dim),)}

    def _advance(self, params: dict, target: Target, next_tokens: jax.Array, features: jax.Array,
                 count: jax.Array, state: dict) -> dict:
        """Run the layer over inputs `(E(next_tokens), features)` `[B, T]` at the cache's next slots, commit
        `count [B]` of them, and keep the output at the last one (the next proposal's base)."""
        embeds = target.embed(next_tokens)

        def run(positions: jax.Array, caches: tuple[KVCache, ...]) -> tuple[jax.Array, tuple[KVCache, ...]]:
            out, cache = self._net(target.config).apply({"params": params}, embeds, features.astype(jnp.float32),
                                                        positions, caches[0])
            return out, (cache,)

        base, caches = run_and_commit(run, state["caches"], next_tokens.shape[1], count)
        return {"base": base, "caches": caches}

    def prefill(self, params: dict, target: Target, prompt: PrefillContext, state: dict) -> dict:
        t = prompt.prompt.shape[1]
        return self._advance(params, target, prompt.next_tokens(), prompt.out.hidden[:, :t], prompt.lengths, state)

    def commit(self, params: dict, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: dict) -> tuple[dict, jax.Array]:
        state = self._advance(params, target, accepted_tokens(proposal, verdict), path_hidden(verdict, verify_out),
                              verdict.n_accepted, state)
        return state, accepted_hidden(verdict, verify_out)

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        draft = FeatureDrafting(self, params, target, ctx)
        if isinstance(tree, TreeBudget):
            return draft.dynamic(tree)
        return draft.static(tree)

    def inputs(self, params: dict, target: Target, tokens: jax.Array, features: jax.Array) -> jax.Array:
        """The draft stack's inputs `FC([E(tokens) ; features])` `[..., D]`."""
        return self._net(target.config).apply({"params": params}, target.embed(tokens), features,
                                              method=_EagleNet.inputs)

    def run_nodes(self, params: dict, target: Target, tokens: jax.Array, parent_features: jax.Array,
                  positions: jax.Array, cache: KVCache, new_mask: jax.Array,
                  prefix: PrefixKV | None) -> tuple[jax.Array, KVCache, jax.Array]:
        """`FeatureDrafting`'s expansion: nodes `tokens [B, M]` with their parents' predicted features through
        the stack -> (their predicted features `[B, M, D]`, the cache with their keys/values written, inputs)."""
        inputs = self.inputs(params, target, tokens, parent_features)
        out, written = self._net(target.config).apply({"params": params}, inputs, positions, cache, new_mask, prefix,
                                                      method=_EagleNet.layers)
        return out, written, inputs

    def logprobs(self, params: dict, target: Target, features: jax.Array) -> jax.Array:
        """Draft log-probabilities `[..., V_d]` of predicted features `[..., D]` through the frozen lm_head (its
        draft vocabulary's columns)."""
        return jax.nn.log_softmax(features @ project_columns(target.lm_head(), self.draft_vocab), axis=-1)

    def draft_logits(self, params: dict, target: Target, tokens: jax.Array, hidden: jax.Array,
                     rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Teacher-forced over whole sequences: `tokens [B, T]`, target features `[B, T, D]` -> (draft logits
        `[B, T, 1, V_d]` of token t + 2, predicted features `[B, T, D]` of f_{t+1}); past the end the inputs wrap
        around and the loss masks them. `rng` adds the feature noise when `feature_noise > 0`."""
        b, t = tokens.shape
        features = hidden.astype(jnp.float32)
        if rng is not None and self.feature_noise > 0:
            features = features + jax.random.uniform(rng, features.shape, minval=-self.feature_noise,
                                                     maxval=self.feature_noise)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        predicted, _ = self._net(target.config).apply({"params": params}, target.embed(jnp.roll(tokens, -1, 1)),
                                                      features, positions, None)
        return (predicted @ project_columns(target.lm_head(), self.draft_vocab))[:, :, None], predicted

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output) -> tuple[jax.Array, dict]:
        """`reg_weight * SmoothL1 + cls_weight * CE(teacher)`; the predicted f_{t+1} is scored where token
        t + 2 (the one it drafts) is a training target. `target_out` needs logits for the CE term."""
        logits, predicted = self.draft_logits(params, target, batch["tokens"], target_out.hidden, batch.get("rng"))
        return self.objective(logits, predicted, batch, target_out)

    def objective(self, logits: jax.Array, predicted: jax.Array, batch: dict,
                  target_out: Output) -> tuple[jax.Array, dict]:
        """The loss of teacher-forced drafts (`draft_logits`' outputs)."""
        t = batch["tokens"].shape[1]
        mask = batch["loss_mask"][:, 2:].astype(jnp.float32)
        reg = optax.huber_loss(predicted[:, : t - 2], target_out.hidden[:, 1: t - 1].astype(jnp.float32)).mean(-1)
        reg = (reg * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        cls, metrics = head_losses(logits, batch, [0.0], target_out.logits, self.cls_weight, teacher_name="cls",
                                   draft_vocab=self.draft_vocab)
        return self.reg_weight * reg + cls, metrics | {"head0/reg": reg}


class _EagleNet(nn.Module):
    target: ModelConfig
    num_layers: int = 1
    input_norm: bool = True

    def setup(self) -> None:
        self.fc = logical_dense(self.target.hidden_size, ("embed", "mlp"), "fc")
        self.layer = decoder_stack(block_config(self.target, self.num_layers), jnp.float32, "xla", name="layer",
                                   input_norm=self.input_norm)

    def __call__(self, embeds: jax.Array, features: jax.Array, positions: jax.Array, cache: KVCache | None,
                 new_mask: jax.Array | None = None, prefix: PrefixKV | None = None) -> tuple[jax.Array, Any]:
        """Inputs `(E(next token), feature)` `[B, T, D]` each -> (predicted next features `[B, T, D]`, cache)."""
        return self.layers(self.inputs(embeds, features), positions, cache, new_mask, prefix)

    def layers(self, x: jax.Array, positions: jax.Array, cache: KVCache | None, new_mask: jax.Array | None = None,
               prefix: PrefixKV | None = None) -> tuple[jax.Array, Any]:
        """The decoder stack on its inputs `[B, T, D]` -> (outputs `[B, T, D]`, cache)."""
        return run_stack(self.layer, block_config(self.target, self.num_layers), x, positions, cache, new_mask, prefix)

    def inputs(self, embeds: jax.Array, features: jax.Array) -> jax.Array:
        """The stack's inputs `FC([E(token) ; feature])` `[..., D]`."""
        return self.fc(jnp.concatenate([embeds, features], axis=-1))
