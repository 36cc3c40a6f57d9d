"""Gumiho (Li et al., 2025): serial heads for the first draft tokens, parallel MLP heads for the rest, and a
lossless Full Tree Attention ("Gumiho: A Hybrid Architecture to Prioritize Early Tokens in Speculative
Decoding", section 3.3, appendix C).

- Serial part: EAGLE's feature-level drafter (`eagle.py`) with a `serial_layers`-layer stack (2) and its own
  KV cache; it drafts depths 1 and 2. Its inputs `o = FC([E(token) ; feature])` of a depth-1 node `a` and of a
  depth-2 node `b` under it (`o_b` reads `a`'s predicted feature) are the parallel heads' input.
- Parallel part: `mlp_heads` (5) MLPs on `[o_a ; o_b]` (2D), each `SiLU(W x + c)` to D then `mlp_layers` (5)
  residual blocks `x + SiLU(W x + c)` (Table 5's shape, the reference code's blocks), every weight
  zero-initialised; head i's output is the predicted feature of depth `2 + i`, read by the target's frozen
  `lm_head`. The heads see only the serial pair, so their drafts at one depth do not depend on the tokens
  drafted at another.
- Tree (`trees.growth.draft_dynamic_tree`, per row on device): EAGLE-2's serial part (the root's `top_k` children;
  the depth-1 frontier through the stack in one call; the global `top_k` of its children form the depth-2
  frontier), then for each depth-2 frontier node its own heads (paired with its own depth-1 parent: the
  reference pairs frontier rows by position instead), expanded as a beam of width `s = budget.max_children`:
  every beam node proposes its origin's top-s tokens of the next head, scored by cumulative log-probability,
  and the best `s` continue. The best nodes of everything drafted are kept, as in EAGLE-2.
- Full Tree Attention (`full_tree_attention`): the published form lengthens short candidate paths with tokens
  of longer paths and reuses those tokens' logits and keys/values, computed under other ancestors, so it can
  commit a token the target would not. Here `trees.growth.extend_short_paths` adds the borrowed tokens as new nodes
  below the short path (verified under the right context, in the same forward); `fta_nodes` of the budget's
  nodes are set aside for them.

Training (appendix C and the reference trainer): teacher-forced on the target's features with uniform noise.
The serial stack's prediction of `f_{t+1}` costs `reg_weight * SmoothL1 + cls_weight * CE(target)`; head i
(0-based) at t reads `[o_t ; o_{t+1}]` (`o_t = FC([E(x_{t+2}) ; predicted f_{t+1}])`) and predicts
`f_{t+3+i}` with the same two terms, weighted `mlp_weight * mlp_decay ** (i + 1)` (1/9 and 0.8 in the
reference trainer). The serial stack keeps every layer's input norm (the reference drops the first one's).

`draft_vocab` (`draft_vocab.py`): the serial part and the heads read the frozen `lm_head` at the draft
vocabulary's columns only (the serial part is EAGLE with the same setting).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from amphista_jax.drafters.base import DraftContext, Drafter, LogicalInit, PrefillContext, Proposal
from amphista_jax.drafters.draft_vocab import normalise_field, project_columns, target_ids
from amphista_jax.drafters.eagle import Eagle
from amphista_jax.drafters.feature_drafting import FeatureDrafting
from amphista_jax.drafters.losses import batch_labels, head_metrics, teacher_ce
from amphista_jax.infra.ranges import setting
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output
from amphista_jax.models.projections import logical_dense
from amphista_jax.models.target import Target
from amphista_jax.trees.growth import Expansion, draft_dynamic_tree, extend_short_paths
from amphista_jax.trees.tree import Tree, TreeBudget, TreeError, arrays_from_parents
from amphista_jax.trees.verify import Verdict


@Drafter.register
@dataclasses.dataclass(frozen=True)
class Gumiho(LogicalInit):
    name = "gumiho"
    tree_kinds = (TreeBudget,)
    paper_tree = "dynamic-63x7x35"  # a 63-node budget: the serial part's depth 2, the MLP heads' 5, beam 35
    serial_layers: int = setting(2, ge=1)
    mlp_heads: int = setting(5, ge=1)
    mlp_layers: int = setting(5, ge=0)  # residual blocks after each head's first 2D -> D block
    top_k: int = setting(10, ge=1)  # the serial part's children and frontiers (EAGLE-2's)
    full_tree_attention: bool = True
    fta_nodes: int = setting(16, ge=0)  # of the budget's nodes, set aside for FTA's extensions
    feature_noise: float = setting(0.1, ge=0, why="0 = no noise")
    reg_weight: float = 1.0
    cls_weight: float = 0.1
    mlp_weight: float = setting(1 / 9, ge=0)
    mlp_decay: float = setting(0.8, ge=0)
    draft_vocab: tuple[int, ...] = ()  # the candidates' target ids (draft_vocab.py); () = the whole vocabulary

    def __post_init__(self) -> None:
        super().__post_init__()
        normalise_field(self)
        self.serial  # noqa: B018 (the serial part validates its own settings)

    @property
    def reads_labels(self) -> bool:
        return False  # EAGLE's loss for the serial part, the target's features and distribution for the heads

    @property
    def max_depth(self) -> int:
        """2 serial drafts, then one per parallel head."""
        return 2 + self.mlp_heads

    def check_tree(self, tree: Tree, vocab_size: int | None = None) -> None:
        if not isinstance(tree, self.tree_kinds):
            super().check_tree(tree, vocab_size)  # says which kind of tree Gumiho needs
        extra = self.fta_nodes if self.full_tree_attention else 0
        s = tree.max_children
        if not 3 <= tree.depth <= self.max_depth or s < self.top_k or tree.num_ranks < s or tree.num_nodes <= extra + 1:
            raise TreeError(f"tree budget {tree} does not fit Gumiho: depth in 3..{self.max_depth} (2 serial + "
                            f"{self.mlp_heads} parallel), max_children = num_ranks >= top_k {self.top_k}, more "
                            f"than {extra + 1} nodes (e.g. --tree {self.paper_tree})")
        super().check_tree(tree, vocab_size)

    @property
    def serial(self) -> Eagle:
        return Eagle(self.serial_layers, self.feature_noise, self.reg_weight, self.cls_weight, self.draft_vocab)

    def init_boxed(self, rng: jax.Array, target: Target) -> dict:
        k1, k2 = jax.random.split(rng)
        d = target.config.hidden_size
        mlps = _ParallelHeads(self.mlp_heads, self.mlp_layers, d).init(k2, jnp.zeros((1, 2 * d)))["params"]
        return {"serial": self.serial.init_boxed(k1, target), "mlps": mlps}

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> dict:
        return self.serial.init_state(target_config, batch, cache_size)

    def prefill(self, params: dict, target: Target, prompt: PrefillContext, state: dict) -> dict:
        return self.serial.prefill(params["serial"], target, prompt, state)

    def commit(self, params: dict, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: dict) -> tuple[dict, jax.Array]:
        return self.serial.commit(params["serial"], target, proposal, verdict, verify_out, state)

    def _heads(self, params: dict, x: jax.Array) -> jax.Array:
        """Parallel heads on `[o_a ; o_b]` `[..., 2D]` -> predicted features `[..., H, D]`."""
        d = x.shape[-1] // 2
        return _ParallelHeads(self.mlp_heads, self.mlp_layers, d).apply({"params": params["mlps"]}, x)

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        depth, s, extra = tree.depth, tree.max_children, self.fta_nodes if self.full_tree_attention else 0
        serial = self.serial
        draft = FeatureDrafting(serial, params["serial"], target, ctx)

        def expand(tokens: jax.Array, carry: Any, level: Expansion, sees: jax.Array,
                   memory: Any) -> tuple[jax.Array, jax.Array, Any, Any]:
            if level.depth == 1:  # the serial stack on the depth-1 frontier: its children are depth 2
                features, _, inputs = draft.expand(tokens, carry, 1, sees, None)  # depth 1 sees no other node
                score, child = draft.top_k(draft.logprobs(features), level.children)
                return score, child, {"feature": features, "input": inputs}, memory
            if level.depth == 2:  # the parallel heads on each depth-2 node's own serial pair
                own = serial.inputs(params["serial"], target, tokens, carry["feature"])
                pair = jnp.concatenate([carry["input"], own], axis=-1)
                carry = draft.top_k(draft.logprobs(self._heads(params, pair)), level.children)  # [B, w, H, s] x 2
            score, child = carry[0][:, :, level.depth - 2], carry[1][:, :, level.depth - 2]
            return score, child, carry, memory

        k = self.top_k
        fanout = ((k, k), (k, k)) + ((s, s),) * (depth - 2)
        base = ctx.state["base"]
        drafted = draft_dynamic_tree(ctx.root, draft.logprobs(base), base, expand, (), tree.num_nodes - 1 - extra,
                                     fanout, target_ids(self.draft_vocab))
        if extra:
            tokens, parent, valid = extend_short_paths(drafted, extra, depth)
        else:
            tokens, parent, valid = drafted.tokens, drafted.parent, jnp.ones(drafted.parent.shape, bool)
        arrays = arrays_from_parents(parent, valid, depth=depth, num_paths=tree.num_paths, max_children=s,
                                     num_ranks=tree.num_ranks)
        return Proposal(tokens, arrays)

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output) -> tuple[jax.Array, dict]:
        """The serial stack's EAGLE loss plus each parallel head's, decayed (see the module docstring)."""
        serial = self.serial
        tokens, t = batch["tokens"], batch["tokens"].shape[1]
        logits, predicted = serial.draft_logits(params["serial"], target, tokens, target_out.hidden,
                                                batch.get("rng"))
        total, metrics = serial.objective(logits, predicted, batch, target_out)
        # o_t = FC([E(x_{t+2}) ; predicted f_{t+1}]); head i at t reads [o_t ; o_{t+1}] and predicts f_{t+3+i}.
        o = serial.inputs(params["serial"], target, jnp.roll(tokens, -2, 1), predicted)
        heads = self._heads(params, jnp.concatenate([o, jnp.roll(o, -1, 1)], axis=-1))  # [B, T, H, D]
        lm_head, mask = project_columns(target.lm_head(), self.draft_vocab), batch["loss_mask"].astype(jnp.float32)
        features = target_out.hidden.astype(jnp.float32)
        for i in range(min(self.mlp_heads, t - 4)):
            shift = 3 + i  # head i at t predicts f_{t+shift}, i.e. drafts token t + shift + 1
            m = mask[:, shift + 1:]
            reg = optax.huber_loss(heads[:, : t - shift - 1, i], features[:, shift: t - 1]).mean(-1)
            reg = (reg * m).sum() / jnp.maximum(m.sum(), 1.0)
            logits_i = heads[:, : t - shift - 1, i] @ lm_head  # [B, T - shift - 1, V_d]
            _, head = head_metrics(logits_i, batch_labels(batch)[:, shift + 1:], m, self.draft_vocab)
            cls = teacher_ce(logits_i, target_out.logits[:, shift: t - 1], m, self.draft_vocab)
            weight = self.mlp_weight * self.mlp_decay ** (i + 1)
            total = total + weight * (self.reg_weight * reg + self.cls_weight * cls)
            metrics |= {f"head{i + 2}/{name}": v for name, v in head.items()}
            metrics |= {f"head{i + 2}/reg": reg, f"head{i + 2}/cls": cls}
        return total, metrics


class _ParallelHeads(nn.Module):
    """`heads` MLPs on one shared input `[..., 2D]` -> `[..., heads, D]`."""

    heads: int
    layers: int
    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        zeros = nn.initializers.zeros_init()
        out = []
        for h in range(self.heads):
            y = nn.silu(logical_dense(self.features, ("embed", "mlp"), f"head{h}_in", zeros)(x))
            for layer in range(self.layers):
                y = y + nn.silu(logical_dense(self.features, ("embed", "mlp"), f"head{h}_res{layer}", zeros)(y))
            out.append(y)
        return jnp.stack(out, axis=-2)
