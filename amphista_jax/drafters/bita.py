"""BiTA (Lin et al., 2024): bi-directional tuning of the frozen target itself; no draft network.

Trainable parameters ("BiTA: Bi-Directional Tuning for Lossless Acceleration in Large Language Models", section 3.1):

* `P` *prompt* tokens, P-tuning v2 style: per-layer keys and values `prompt_k, prompt_v [L, P, KVH, Dh]`
  (no rotary position on them), seen by the mask tokens alone, so the target's own outputs never change;
* `M` distinct *mask* token embeddings `masks [M, D]` (N(0, 0.02)); the paper uses M = 3 for targets up to
  13B parameters and 4 above (`BiTA.for_target`).

A mask group after a token at position p holds the M masks at positions p + 1 .. p + M (positions follow the
visible non-prompt keys); the target's output at mask i (1-based) predicts the token at p + i + 1. The token
at p + 1 is the target's own prediction (the bonus), so mask i drafts depth i of the next tree.

Decoding keeps the KV cache (the committed prefix is cached; masks are never committed) and takes one target
forward per step (section 3.2, appendix B): the verify forward carries the candidate tree and one group of M
masks after every tree node (node 0, the root, included), `E = N * M` extras. Visibility:

* tree nodes see the committed prefix and their ancestors, never a prompt key or a mask (the engine's rule
  for extras), so the target's logits at the tree are those of a forward without BiTA;
* the group of node n sees the prompt keys, the committed prefix, node n's path (root .. n) and the earlier
  masks of its own group (and itself); groups never see each other.

A small tree (root r, a = rank 0 and b = rank 1 at depth 1, c = a's rank-0 child) with M = 2, the committed
prefix C of length L and the prompt keys P (`mask_groups`; the test checks this matrix)::

                   P  C | r  a  b  c | r1 r2 a1 a2 b1 b2 c1 c2   position
    r              .  1 | 1  .  .  . | .  .  .  .  .  .  .  .   L
    a              .  1 | 1  1  .  . | .  .  .  .  .  .  .  .   L + 1
    b              .  1 | 1  .  1  . | .  .  .  .  .  .  .  .   L + 1
    c              .  1 | 1  1  .  1 | .  .  .  .  .  .  .  .   L + 2
    r1             1  1 | 1  .  .  . | 1  .  .  .  .  .  .  .   L + 1
    r2             1  1 | 1  .  .  . | 1  1  .  .  .  .  .  .   L + 2
    a1             1  1 | 1  1  .  . | .  .  1  .  .  .  .  .   L + 2
    a2             1  1 | 1  1  .  . | .  .  1  1  .  .  .  .   L + 3
    b1             1  1 | 1  .  1  . | .  .  .  .  1  .  .  .   L + 2
    b2             1  1 | 1  .  1  . | .  .  .  .  1  1  .  .   L + 3
    c1             1  1 | 1  1  .  1 | .  .  .  .  .  .  1  .   L + 3
    c2             1  1 | 1  1  .  1 | .  .  .  .  .  .  1  1   L + 4

After acceptance, `commit` keeps the logits of the group attached to the last accepted node (the one whose
own logits gave the bonus token): mask i's top-k fill depth i of the next static tree (`topk_proposal`, as
Medusa's heads do; the paper's tree, where only top-1 candidates have children, is `trees.tree.efficient_tree`:
`--tree efficient-3x5`). Drafts are deterministic top-k (`q = None`), so greedy and lossless rejection sampling
both apply. The prefill runs the prompt's own mask group (`prefill_extras`) so the first step already has
drafts.

Training (`loss`, section 3.1 with the efficient layout): the SAR loss of equation (1) in ONE forward of the
frozen target per sequence. G mask groups sit at consecutive cut points p = s .. s + G - 1 of each row; the
group at cut p is the decoding layout above with the sequence's own tokens as the accepted path: its mask i
(1-based) sits at position p + i, sees tokens 0 .. p, the prompt keys and the earlier masks of its group, and
is trained on the token at p + i + 1 (under `loss_mask`). The sequence's tokens see no mask and no prompt key,
so the target's own outputs are those of a plain forward. The drafter sets `loss_runs_target`: the train step
hands it no stop-gradient target output, and gradients flow through the frozen target (whose params are not
differentiated) into the masks and the prompt. The target's layers are recomputed in the backward pass
(`remat`): keeping their activations over T + G * M tokens does not fit a 7B pod's devices. Prompt dropout is
element-wise inverted dropout on the prompt keys/values (P-tuning v2's dropout on its `past_key_values`), with
`batch["rng"]` when the batch has one.
"""

from __future__ import annotations

import dataclasses

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
    logical,
    topk_proposal,
)
from amphista_jax.drafters.losses import head_metrics
from amphista_jax.infra.ranges import setting
from amphista_jax.models.attention import causal_mask
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output, target_model
from amphista_jax.models.target import Extras, Target, forward
from amphista_jax.trees.tree import Tree, TreeArrays
from amphista_jax.trees.verify import Verdict, last_accepted_node

LARGE_TARGET = 13.5e9  # the paper: 3 mask tokens for targets up to 13B parameters, 4 above


def own_group_visibility(batch: int, groups: int, num_masks: int) -> jax.Array:
    """`[B, G * M, G * M]`: each mask of `groups` consecutive groups of `num_masks` sees the earlier masks of its
    own group and itself, never another group's."""
    e = groups * num_masks
    group = np.arange(e) // num_masks
    own = (group[:, None] == group[None, :]) & (np.arange(e)[None, :] <= np.arange(e)[:, None])
    return jnp.broadcast_to(jnp.asarray(own), (batch, e, e))


def mask_groups(tree: TreeArrays, lengths: jax.Array, num_masks: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One group of `num_masks` masks after every node of the per-row `tree [B, N, ...]` (device data), extra
    e = n * M + j being mask j + 1 of node n's group. Returns their positions `[B, E]` (node n at `lengths +
    depth[n]`, its mask j + 1 at `lengths + depth[n] + j + 1`), the nodes each sees `sees_new [B, E, N]` (node
    n's path: its ancestor-or-self row of `tree.mask`) and the masks each sees `sees_extras [B, E, E]` (the
    earlier masks of its own group and itself)."""
    b, n = tree.depth.shape
    m = num_masks
    step = jnp.arange(1, m + 1, dtype=jnp.int32)
    positions = (lengths[:, None, None] + tree.depth[:, :, None] + step).reshape(b, n * m)
    sees_new = jnp.repeat(tree.mask, m, axis=1)  # [B, N * M, N]
    return positions, sees_new, own_group_visibility(b, n, m)


@Drafter.register
@dataclasses.dataclass(frozen=True)
class BiTA(LogicalInit):
    name = "bita"
    num_masks: int = setting(3, ge=1, why="the masks draft the tree")  # M mask tokens: drafts up to depth M
    num_prompt: int = setting(16, ge=0)  # P prompt tokens per layer (0: mask tokens only, the paper's ablation)
    prompt_dropout: float = setting(0.1, ge=0, lt=1)  # on the prompt keys/values in training (not used by decoding)
    # G mask groups per sequence in training (consecutive cut points); 0: every cut point
    train_groups: int = setting(0, ge=0, why="0: a mask group at every cut point")
    remat: bool = True  # training recomputes each target layer in the backward pass (keeps one layer's activations)
    loss_runs_target = True  # the loss runs the frozen target itself (train/step.py passes no target output)

    def check_batches(self, length_grouped: bool) -> None:
        if length_grouped and self.train_groups:
            raise ValueError("BiTA's drafter.train_groups cut points depend on the batch's length, which "
                             "data.length_groups cuts short: set one of them to 0")

    @property
    def paper_tree(self) -> str:
        """The paper's efficient tree: top-5 at each depth up to M (section 4.1)."""
        return f"efficient-{self.num_masks}x5"

    @property
    def max_depth(self) -> int:
        """Mask i drafts depth i."""
        return self.num_masks

    @classmethod
    def for_target(cls, config: ModelConfig, **overrides) -> BiTA:
        """The paper's settings for `config`: 3 mask tokens up to 13B parameters, 4 above."""
        return cls(**({"num_masks": 3 if config.num_params <= LARGE_TARGET else 4} | overrides))

    def init_boxed(self, rng: jax.Array, target: Target) -> dict:
        c = target.config
        k_masks, k_keys, k_values = jax.random.split(rng, 3)
        params = {"masks": logical(0.02 * jax.random.normal(k_masks, (self.num_masks, c.hidden_size)), None, "embed")}
        if self.num_prompt:
            shape = (c.num_layers, self.num_prompt, c.num_kv_heads, c.head_dim)  # [L, P, KVH, Dh]
            axes = ("layers", None, "kv_heads", None)
            params |= {"prompt_k": logical(0.02 * jax.random.normal(k_keys, shape), *axes),
                       "prompt_v": logical(0.02 * jax.random.normal(k_values, shape), *axes)}
        return params

    def num_extras(self, tree: Tree) -> int:
        return tree.num_nodes * self.num_masks

    def _extras(self, params: dict, positions: jax.Array, sees_new: jax.Array, sees_extras: jax.Array) -> Extras:
        """The masks as extras (the mask embeddings tiled over the groups) with the prompt keys/values."""
        b, e = positions.shape
        embeds = jnp.broadcast_to(jnp.tile(params["masks"], (e // self.num_masks, 1)), (b, e, params["masks"].shape[1]))
        pk = pv = None
        if self.num_prompt:
            per_row = lambda x: jnp.broadcast_to(x[:, None], (x.shape[0], b) + x.shape[1:])  # noqa: E731
            pk, pv = per_row(params["prompt_k"]), per_row(params["prompt_v"])  # [L, B, P, KVH, Dh]
        return Extras(embeds, positions, sees_new, sees_extras, pk, pv)

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> dict:
        # fp32 logits [B, M, V] of the mask group after the last committed token: the next tree's drafts
        return {"logits": jnp.zeros((batch, self.num_masks, target_config.vocab_size), jnp.float32)}

    def prefill_extras(self, params: dict, target: Target, prompt: jax.Array, lengths: jax.Array) -> Extras:
        """The prompt's mask group: after each row's last prompt token, seeing the whole prompt."""
        b, t = prompt.shape
        m = self.num_masks
        positions = lengths[:, None] + jnp.arange(m, dtype=jnp.int32)
        sees_prompt = jnp.broadcast_to(jnp.arange(t)[None, None] < lengths[:, None, None], (b, m, t))
        return self._extras(params, positions, sees_prompt, own_group_visibility(b, 1, m))

    def prefill(self, params: dict, target: Target, prompt: PrefillContext, state: dict) -> dict:
        hidden = prompt.out.hidden[:, prompt.prompt.shape[1]:]  # [B, M, D] the prompt's mask group
        return state | {"logits": hidden.astype(jnp.float32) @ target.lm_head()}

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        proposal = topk_proposal(ctx.state["logits"][:, :max(tree.depth, 1)], ctx.root, tree)
        positions, sees_new, sees_extras = mask_groups(proposal.tree, ctx.lengths, self.num_masks)
        return proposal.replace(extras=self._extras(params, positions, sees_new, sees_extras))

    def commit(self, params: dict, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: dict) -> tuple[dict, jax.Array]:
        """Keep the logits of the group after the last accepted node (which also gave the bonus token)."""
        n, m = proposal.tokens.shape[1], self.num_masks
        rows = n + last_accepted_node(verdict)[:, None] * m + jnp.arange(m)  # [B, M]
        logits = jnp.take_along_axis(verify_out.logits, rows[:, :, None], axis=1)
        return state | {"logits": logits.astype(jnp.float32)}, accepted_hidden(verdict, verify_out)

    def _cut_points(self, batch: dict) -> jax.Array:
        """`[B, G]` consecutive cut points per row. G = `train_groups` (0: T - 2, every cut whose mask 1 has a
        label). They start at the cut before the row's first loss token, shifted by a uniform random offset
        within the row when the batch carries an `rng` (training)."""
        tokens, mask = batch["tokens"], batch["loss_mask"]
        b, t = tokens.shape
        g = min(self.train_groups or t - 2, t - 2)
        if g < 1:
            raise ValueError(f"BiTA training needs sequences of >= 3 tokens, got {t}")
        last = t - 1 - g  # the latest start whose groups all lie within the row
        lo = jnp.clip(jnp.argmax(mask > 0, axis=1) - 1, 0, last)  # [B]
        if "rng" in batch:
            lo = lo + jax.random.randint(jax.random.fold_in(batch["rng"], 1), (b,), 0, last - lo + 1)
        return lo[:, None] + jnp.arange(g, dtype=jnp.int32)  # [B, G]

    def _training_extras(self, params: dict, cuts: jax.Array, t: int, rng: jax.Array | None) -> Extras:
        """The groups at `cuts [B, G]` as extras over a sequence of `t` tokens: group g's masks at positions
        cut + 1 .. cut + M, seeing tokens 0 .. cut and the earlier masks of their own group."""
        b, g = cuts.shape
        m = self.num_masks
        positions = (cuts[:, :, None] + jnp.arange(1, m + 1, dtype=jnp.int32)).reshape(b, g * m)  # [B, E]
        sees_new = jnp.repeat(jnp.arange(t)[None, None, :] <= cuts[:, :, None], m, axis=1)  # [B, E, T]
        extras = self._extras(params, positions, sees_new, own_group_visibility(b, g, m))
        if self.num_prompt and self.prompt_dropout and rng is not None:
            keep = 1.0 - self.prompt_dropout
            k_k, k_v = jax.random.split(jax.random.fold_in(rng, 2))
            drop = lambda x, k: jnp.where(jax.random.bernoulli(k, keep, x.shape), x / keep, 0.0)  # noqa: E731
            extras = extras.replace(prefix_k=drop(extras.prefix_k, k_k), prefix_v=drop(extras.prefix_v, k_v))
        return extras

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output | None = None
             ) -> tuple[jax.Array, dict]:
        """The SAR loss (equation (1)): the sum over masks i of the masked mean CE of mask i of every group
        against the token at its cut + i + 1, from one forward of the frozen target over `batch["tokens"] [B,
        T]` with G = `train_groups` groups attached (see the module docstring). `target_out` is not used (the
        loss runs the target itself: `loss_runs_target`). Metrics `head{i-1}/loss|top1|top5` per mask i."""
        tokens = batch["tokens"]
        b, t = tokens.shape
        m = self.num_masks
        cuts = self._cut_points(batch)  # [B, G]
        g = cuts.shape[1]
        extras = self._training_extras(params, cuts, t, batch.get("rng"))
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        model = target_model(target.config, target.params, remat=self.remat)
        out = forward(model, target.params, tokens, positions, None, causal_mask(b, t), extras, return_logits=False)
        hidden = out.hidden[:, t:].astype(jnp.float32).reshape(b, g, m, -1)  # [B, G, M, D]
        label_pos = cuts[:, :, None] + jnp.arange(2, m + 2, dtype=jnp.int32)  # [B, G, M] mask i: cut + i + 1
        inside = label_pos < t
        flat = jnp.clip(label_pos, 0, t - 1).reshape(b, g * m)
        labels = jnp.take_along_axis(tokens, flat, 1).reshape(b, g, m)
        weights = (jnp.take_along_axis(batch["loss_mask"], flat, 1).reshape(b, g, m) > 0) & inside
        lm_head = target.lm_head()
        total, metrics = 0.0, {}
        for i in range(m):
            head_loss, head = head_metrics(hidden[:, :, i] @ lm_head, labels[:, :, i],
                                           weights[:, :, i].astype(jnp.float32))
            total = total + head_loss
            metrics |= {f"head{i}/{name}": v for name, v in head.items()}
        return total, metrics
