"""EAGLE-3 (Li et al., 2025, arXiv 2503.01840): fused low / middle / high target features, one draft layer trained
by *training-time test*, a draft vocabulary, EAGLE-2's dynamic tree.

Features: the target forward keeps the inputs of three of its layers (`feature_layers`; the reference's layers 2,
L // 2 and L - 3, each the residual stream before that layer) at prefill and at every verify
(`Drafter.captured_layers`, `Output.captured [B, T, 3D]`), in the same forward, with only those three arrays kept.
`fc: 3D -> D` (no bias) fuses them.

The draft layer (`midlayer`) is one decoder layer of the target's block type whose attention reads
`[input_norm(E(token)) ; hidden_norm(feature)]` (2D wide) and whose residual stream starts from the feature
(`llama.DecoderLayer(fused_input=True)`); its own `norm` and `lm_head [D, V_d]` (initialised from the target's
`lm_head` at the draft vocabulary's columns, then trained) give the draft distribution. Slot `p` of its cache
holds the input `(E(x_{p+1}), fc(captured_p))` of a committed position; a drafted node's input is its token with
its parent's draft-layer output (not `fc` of anything): the feature is the layer's own output from depth 2 on.
Decoding is EAGLE's (`feature_drafting.FeatureDrafting`, static trees or EAGLE-2's dynamic one).

Training-time test (the reference's `traineagle3/cnets.py`, `length = 7`): the layer is unrolled `ttt_steps` times
over the whole sequence. Step 0 is teacher-forced: position t reads `(E(x_{t+1}), fc(captured_t))` at position t
under a causal mask and drafts x_{t+2}. Step j > 0 reads `(E(x_{t+1+j}), its own step j - 1 output at t)` at
position t + j, and attends to step 0's keys at positions <= t and to steps 1..j's keys at t alone: the ancestors a
depth-(j + 1) node has at decode, so that the step-j drafts of training are the drafts decoding makes from the same
inputs. It drafts x_{t+2+j}. Steps 1..j's keys are scored per query (`PrefixKV.diagonal_k`), so step j scores `T x
(T + j)` rather than `T x (j + 1) T`: the unrolled attention grows as `k T^2`, not `k^2 T^2`. Loss: `sum_j
step_decay**j * CE(draft_j, softmax(target logits restricted to the draft vocabulary))`, the reference's 0.8 per
step, with no feature regression (`teacher_weight` 1); `lm_weight` > 0 adds the LM term on the labels `loss`
chooses (`head_losses`), which an ablation can set in the teacher term's place. Each step's term is a mean over
its trained positions (the reference divides by every position); step j's metrics are `head{j}/...` (top-1
against the data's token t + 2 + j, the same place Medusa's head j drafts). """

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
    logical,
)
from amphista_jax.drafters.causal_layers import at_path, block_config, run_and_commit, with_rope_base
from amphista_jax.drafters.draft_vocab import normalise_field, project_columns
from amphista_jax.drafters.feature_drafting import FeatureDrafting
from amphista_jax.drafters.losses import check_loss_weights, head_losses
from amphista_jax.infra.ranges import setting
from amphista_jax.models.attention import causal_mask
from amphista_jax.models.cache import KVCache
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import DecoderLayer, Output, PrefixKV, RMSNorm, run_stack
from amphista_jax.models.projections import logical_dense
from amphista_jax.models.target import Target
from amphista_jax.trees.tree import Tree, TreeBudget, TreeSpec
from amphista_jax.trees.verify import Verdict

NUM_FEATURES = 3  # low, middle, high


def reference_layers(num_layers: int) -> tuple[int, ...]:
    """The reference's feature layers for a target of `num_layers`: 2, L // 2, L - 3 (clamped into a shallow
    target's layers)."""
    return min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)


@Drafter.register
@dataclasses.dataclass(frozen=True)
class Eagle3(LogicalInit):
    lm_setting = "lm_weight"
    name = "eagle3"
    paper_tree = "dynamic"  # EAGLE-2's dynamic tree, as EAGLE-3 decodes
    tree_kinds = (TreeSpec, TreeBudget)
    feature_layers: tuple[int, ...] = ()  # 3 target layers whose inputs are fused; () = reference_layers(L)
    # training-time test: steps the layer is unrolled on its own outputs
    ttt_steps: int = setting(7, ge=1, why="1 = no unrolling: plain teacher forcing")
    step_decay: float = setting(0.8, gt=0, le=1)  # step j's loss weight is step_decay ** j
    lm_weight: float = 0.0  # CE against the labels `loss` chooses (the data's tokens by default)
    teacher_weight: float = 1.0  # CE against the target's softmax (the reference's only term)
    draft_vocab: tuple[int, ...] = ()  # the candidates' target ids (draft_vocab.py, the reference's d2t)
    # the draft layer's RoPE base (released heads: their config's)
    rope_theta: float = setting(0.0, ge=0, why="0 = the target's RoPE base")

    def __post_init__(self) -> None:
        super().__post_init__()
        normalise_field(self)
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if self.feature_layers and len(self.feature_layers) != NUM_FEATURES:
            raise ValueError(f"feature_layers={list(self.feature_layers)} must name {NUM_FEATURES} target layers "
                             "(low, middle, high), or be empty for the reference's 2, L // 2, L - 3")
        check_loss_weights(lm_weight=self.lm_weight, teacher_weight=self.teacher_weight)

    def captured_layers(self, config: ModelConfig) -> tuple[int, ...]:
        layers = self.feature_layers or reference_layers(config.num_layers)
        if not all(0 <= i < config.num_layers for i in layers):
            raise ValueError(f"feature_layers={list(layers)} must be layers of the target's {config.num_layers}")
        return layers

    def _net(self, target: ModelConfig) -> _Eagle3Net:
        return _Eagle3Net(with_rope_base(target, self.rope_theta))

    def init_boxed(self, rng: jax.Array, target: Target) -> dict:
        c = target.config
        self.captured_layers(c)
        x = jnp.zeros((1, 1, c.hidden_size))
        params = self._net(c).init(rng, x, jnp.zeros((1, 1, NUM_FEATURES * c.hidden_size)),
                                   jnp.zeros((1, 1), jnp.int32))["params"]
        lm_head = jnp.copy(project_columns(target.lm_head(), self.draft_vocab))  # own buffer: trained, donated
        return params | {"lm_head": logical(lm_head, "embed", "vocab")}

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> dict:
        c = target_config
        return {"base": jnp.zeros((batch, c.hidden_size), jnp.float32),
                "caches": (KVCache.zeros(1, batch, cache_size, c.num_kv_heads, c.head_dim),)}

    def _advance(self, params: dict, target: Target, next_tokens: jax.Array, captured: jax.Array,
                 count: jax.Array, state: dict) -> dict:
        """Run the layer over committed inputs `(E(next_tokens), fc(captured))` `[B, T]` at the cache's next
        slots, commit `count [B]` of them, keep the output at the last one (the next proposal's base)."""
        net = self._net(target.config)
        x = jnp.concatenate([target.embed(next_tokens),
                             net.apply({"params": params}, captured.astype(jnp.float32), method=_Eagle3Net.fuse)], -1)

        def run(positions: jax.Array, caches: tuple[KVCache, ...]) -> tuple[jax.Array, tuple[KVCache, ...]]:
            out, cache = net.apply({"params": params}, x, positions, caches[0], method=_Eagle3Net.layer)
            return out, (cache,)

        base, caches = run_and_commit(run, state["caches"], next_tokens.shape[1], count)
        return {"base": base, "caches": caches}

    def prefill(self, params: dict, target: Target, prompt: PrefillContext, state: dict) -> dict:
        t = prompt.prompt.shape[1]
        return self._advance(params, target, prompt.next_tokens(), prompt.out.captured[:, :t], prompt.lengths, state)

    def commit(self, params: dict, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: dict) -> tuple[dict, jax.Array]:
        state = self._advance(params, target, accepted_tokens(proposal, verdict),
                              at_path(verdict, verify_out.captured), verdict.n_accepted, state)
        return state, accepted_hidden(verdict, verify_out)

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        draft = FeatureDrafting(self, params, target, ctx)
        return draft.dynamic(tree) if isinstance(tree, TreeBudget) else draft.static(tree)

    def run_nodes(self, params: dict, target: Target, tokens: jax.Array, parent_features: jax.Array,
                  positions: jax.Array, cache: KVCache, new_mask: jax.Array,
                  prefix: PrefixKV | None) -> tuple[jax.Array, KVCache, None]:
        """`FeatureDrafting`'s expansion: drafted nodes `tokens [B, M]` with their parents' layer outputs
        `[B, M, D]` -> (their outputs `[B, M, D]`, the cache with their keys/values written, None)."""
        x = jnp.concatenate([target.embed(tokens), parent_features], -1)
        out, written = self._net(target.config).apply({"params": params}, x, positions, cache, new_mask, prefix,
                                                       method=_Eagle3Net.layer)
        return out, written, None

    def logprobs(self, params: dict, target: Target, features: jax.Array) -> jax.Array:
        """Draft log-probabilities `[..., V_d]` of layer outputs `[..., D]` (its norm and its own lm_head)."""
        return jax.nn.log_softmax(self._net(target.config).apply({"params": params}, features,
                                                                 method=_Eagle3Net.logits), axis=-1)

    def draft_logits(self, params: dict, target: Target, tokens: jax.Array, captured: jax.Array) -> jax.Array:
        """Training-time test over whole sequences (module docstring): `tokens [B, T]`, the target's captured
        features `[B, T, 3D]` -> draft logits `[B, T, ttt_steps, V_d]`, step j's at t drafting token t + 2 + j.
        Past the end the inputs wrap around; the loss masks those positions."""
        b, t = tokens.shape
        c = target.config
        net = self._net(c)
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        feature = net.apply({"params": params}, captured.astype(jnp.float32), method=_Eagle3Net.fuse)
        keys: list[jax.Array] = []  # per step [1, B, T, KVH, Dh], rotated at that step's positions
        values: list[jax.Array] = []
        logits = []
        for j in range(self.ttt_steps):
            x = jnp.concatenate([target.embed(jnp.roll(tokens, -1 - j, axis=1)), feature], -1)
            prefix = None
            if j:  # step 0's keys causally; steps 1..j-1's and its own at the query's position only
                prefix = PrefixKV(keys[0], values[0], causal_mask(b, t),  # [1, B, T, j - 1, KVH, Dh] x 2:
                                  jnp.stack(keys, 3)[:, :, :, 1:], jnp.stack(values, 3)[:, :, :, 1:])
            scratch = KVCache.zeros(1, b, t, c.num_kv_heads, c.head_dim)  # lengths 0: holds this step's keys only
            # (step j > 0 sees its own key alone, by the diagonal prefix: the causal mask is read at step 0 only)
            feature, written = net.apply({"params": params}, x, positions + j, scratch, causal_mask(b, t), prefix,
                                         method=_Eagle3Net.layer)
            keys.append(written.k)
            values.append(written.v)
            logits.append(net.apply({"params": params}, feature, method=_Eagle3Net.logits))
        return jnp.stack(logits, axis=2)

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output) -> tuple[jax.Array, dict]:
        """`sum_j step_decay**j * (teacher_weight * CE(step j's drafts, the target's distribution over the draft
        vocabulary) + lm_weight * the LM term on `loss`'s labels)`; `target_out` needs the captured features, and
        logits for the teacher term."""
        logits = self.draft_logits(params, target, batch["tokens"], target_out.captured)
        decay = [self.step_decay ** j for j in range(self.ttt_steps)]
        return head_losses(logits, batch, [self.lm_weight * w for w in decay],
                           target_out.logits if self.teacher_weight else None,
                           [self.teacher_weight * w for w in decay], teacher_name="ttt", draft_vocab=self.draft_vocab)


class _Eagle3Net(nn.Module):
    target: ModelConfig

    def setup(self) -> None:
        c = self.target
        self.fc = logical_dense(c.hidden_size, ("embed", "mlp"), "fc", use_bias=False)
        self.midlayer = [DecoderLayer(block_config(c, 1), jnp.float32, "xla", fused_input=True)]
        self.norm = RMSNorm(c.rms_norm_eps)

    def __call__(self, embeds: jax.Array, captured: jax.Array, positions: jax.Array) -> jax.Array:
        """Init only: every parameter but `lm_head` (set from the target's by `Eagle3.init_boxed`)."""
        out, _ = self.layer(jnp.concatenate([embeds, self.fuse(captured)], -1), positions, None)
        return self.norm(out)

    def fuse(self, captured: jax.Array) -> jax.Array:
        """`fc`: the captured features `[..., 3D]` -> `[..., D]`."""
        return self.fc(captured)

    def layer(self, x: jax.Array, positions: jax.Array, cache: KVCache | None, new_mask: jax.Array | None = None,
              prefix: PrefixKV | None = None) -> tuple[jax.Array, Any]:
        """The draft layer on `[E(token) ; feature]` `[B, T, 2D]` -> (outputs `[B, T, D]`, cache)."""
        return run_stack(self.midlayer, block_config(self.target, 1), x, positions, cache, new_mask, prefix)

    def logits(self, out: jax.Array) -> jax.Array:
        """Draft logits `[..., V_d]` of layer outputs `[..., D]`: `lm_head(norm(out))`."""
        return self.norm(out) @ self.variables["params"]["lm_head"]  # [D, V_d], set by Eagle3.init_boxed
