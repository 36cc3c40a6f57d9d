"""Semi-autoregressive drafting ("Semi-autoregressive Decoding for Efficient LLM Inference", sections 3-4, appendix A).

The target models the distant tokens through its last hidden state `h_p` at the step's base position (the one
that produced the root), computed once per step; a tiny language model models the recent ones, the draft so far::

    q(d_j) = q0(h_p, h_q(d_1 .. d_{j-1}))                              # Eq. 5; d_1 = the root
    q0(h_p, h_q) = W3^T act(concat(Wp^T h_p, Wq^T h_q) + b3)            # appendix A

`h_q` is one of the paper's two encoders over the embeddings `e(d_l)` (the target's own input embeddings):

* `encoder="simplified"`, the simplified transformer (Eq. 6): `sum_l alpha_l MLP(e(d_l)) / sum_l alpha_l`, an
  average with learned per-position weights `alpha_l = sigmoid(a_l)` in (0, 1) (one per draft position, `a`
  starts at 0: a plain mean) of a 2-layer MLP of width H/2 (`Dense(H/2) -> act -> Dense(H/2)`);
* `encoder="lstm"`: a 2-layer LSTM of width H/2 (Eq. 7), its last layer's hidden state after the last token.

`act` is the target's activation (SiLU: the only one Llama-family configs here use). One network serves every
depth: unlike Medusa's or Hydra's K heads it has one vocabulary projection `W3` ("lm_head", `[2W, V]`), which
starts as the target's `lm_head` when `2W == H` and random otherwise. `width` is W, the width of each branch of
`q0`'s hidden layer (the paper's 1024 for H = 4096; None = H/4).

Readings of the paper, chosen so that no label can leak:
* Eq. 8 writes `h_q(w_{i+1}, ..., w_{i+j})` for the draft of `w_{i+j}`, which would feed the label to its own
  prediction; we follow Eq. 5 instead: the draft of depth j reads `h_q` over the root and the path's first j - 1
  drafted tokens (the root is the target's own next token, `d_1 = w_{i+1}` in Fig. 3), never the token drafted.
* Section 4.2 calls `q0` "an MLP with two hidden layers"; appendix A gives its formula with one: we use the formula.

Training is the draft term of Eq. 8 with the target frozen (the paper's "separate" mode): the mean over depths
1..k of the CE of each depth's draft, teacher-forced on the ground truth: at position t (whose hidden state
produced token t + 1), depth j (0-based) reads tokens t + 1 .. t + 1 + j and drafts token t + 2 + j.

Drafting fills a static tree depth by depth, as Hydra does: every node that has children runs `q0` once on its
own path's encoder state (batched over the level), its children take the top-k, and the encoder steps once per
expanded child. There is no cache of its own: nothing to prefill or commit.

`draft_vocab` (`draft_vocab.py`): `W3` covers only the draft vocabulary's columns (`[2W, V_d]`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from amphista_jax.drafters.base import DraftContext, Drafter, LogicalInit, Proposal, draft_by_levels, logical
from amphista_jax.drafters.draft_vocab import check_fits, normalise_field, project_columns
from amphista_jax.drafters.losses import head_losses
from amphista_jax.infra.ranges import setting
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output
from amphista_jax.models.projections import logical_dense
from amphista_jax.models.target import Target
from amphista_jax.trees.tree import Tree

ENCODERS = ("simplified", "lstm")
Carry = Any  # the encoder's state over a path: a pytree of `[..., H/2]` (and `[..., 1]`) arrays


@Drafter.register
@dataclasses.dataclass(frozen=True)
class SemiAutoregressive(LogicalInit):
    name = "sar"
    # k: draft depths trained (Eq. 8) and the deepest tree drafted; named like the head methods' depth, which the
    # tree code (tree search, the CLI's checks) reads from every static-tree drafter
    num_heads: int = setting(4, ge=1, why="the draft depth k")
    encoder: str = "simplified"  # h_q: "simplified" (Eq. 6) or "lstm" (Eq. 7)
    # W, each branch of q0's hidden layer; None = H/4 (the paper's 1024 at H = 4096)
    width: int | None = setting(None, ge=1, why="or None for H/4")
    draft_vocab: tuple[int, ...] = ()  # the candidates' target ids (draft_vocab.py); () = the whole vocabulary

    def __post_init__(self) -> None:
        super().__post_init__()
        normalise_field(self)
        if self.encoder not in ENCODERS:
            raise ValueError(f"{self.encoder=} must be one of {ENCODERS}")

    def _net(self, target: ModelConfig) -> _SARNet:
        return _SARNet(self, target)

    def branch_width(self, target: ModelConfig) -> int:
        return self.width or max(1, target.hidden_size // 4)

    def init_boxed(self, rng: jax.Array, target: Target) -> dict:
        config = target.config
        d = config.hidden_size
        path = jnp.zeros((1, 1, self.num_heads, d))
        params = self._net(config).init(rng, jnp.zeros((1, 1, d)), path)["params"]
        features = 2 * self.branch_width(config)
        check_fits(self.draft_vocab, config.vocab_size)
        if features == d:
            lm_head = project_columns(target.lm_head(), self.draft_vocab)  # [D, V_d]
        else:
            v = len(self.draft_vocab) or config.vocab_size
            lm_head = jax.random.normal(jax.random.fold_in(rng, 1), (features, v)) / jnp.sqrt(features)
        return params | {"lm_head": logical(lm_head, "embed", "vocab")}

    @property
    def max_depth(self) -> int:
        """One network drafts every depth up to k = num_heads."""
        return self.num_heads

    def _apply(self, params: dict, target: Target, method: Any, *args: Any) -> Any:
        return self._net(target.config).apply({"params": params}, *args, method=method)

    def _logits(self, params: dict, target: Target, base: jax.Array, carry: Carry) -> jax.Array:
        """q0 on base states `[..., D]` and encoder states over paths -> fp32 logits `[..., V_d]`."""
        return (self._apply(params, target, _SARNet.mix, base, carry) @ params["lm_head"]).astype(jnp.float32)

    def _step(self, params: dict, target: Target, carry: Carry, tokens: jax.Array, position: int) -> Carry:
        """The encoder state after one more path token: `tokens [...]` at path position `position` (root: 0)."""
        return self._apply(params, target, _SARNet.step, carry, target.embed(tokens), position)

    def path_logits(self, params: dict, target: Target, base: jax.Array, path: jax.Array) -> jax.Array:
        """The draft after a path, from scratch: base states `[..., D]` (broadcast) and path tokens `[..., j]` (the
        root first, j <= num_heads) -> fp32 logits `[..., V_d]` of the token that follows the path."""
        carry = self._apply(params, target, _SARNet.empty, path.shape[:-1])
        for position in range(path.shape[-1]):
            carry = self._step(params, target, carry, path[..., position], position)
        return self._logits(params, target, base.astype(jnp.float32), carry)

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        """Deterministic top-k drafts (`q = None`), depth by depth: each node's children are the top-k of `q0`
        on that node's own path (root .. node)."""
        base = ctx.hidden.astype(jnp.float32)[:, None]  # [B, 1, D]
        carry = self._apply(params, target, _SARNet.empty, (ctx.root.shape[0], 1))
        carry = self._step(params, target, carry, ctx.root[:, None], 0)  # the encoder over each node's path
        return draft_by_levels(ctx.root, tree, carry, lambda depth, c: self._logits(params, target, base, c),
                               lambda depth, c, children: self._step(params, target, c, children, depth + 1),
                               self.draft_vocab)

    def draft_logits(self, params: dict, target: Target, tokens: jax.Array, hidden: jax.Array) -> jax.Array:
        """Training-time drafts over whole sequences, teacher-forced: `tokens [B, T]`, target hidden `[B, T, D]`
        -> `[B, T, K, V_d]` (depth j at t reads tokens t + 1 .. t + 1 + j; past the end they wrap around and the
        loss masks them)."""
        embed = target.embed(tokens)  # [B, T, D]
        path = jnp.stack([jnp.roll(embed, -(j + 1), axis=1) for j in range(self.num_heads)], axis=2)  # [B, T, K, D]
        features = self._net(target.config).apply({"params": params}, hidden.astype(jnp.float32), path)
        return (features @ params["lm_head"]).astype(jnp.float32)

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output) -> tuple[jax.Array, dict]:
        """Eq. 8's draft term: the mean over depths of the ground-truth CE (`head{j}/...` metrics per depth)."""
        logits = self.draft_logits(params, target, batch["tokens"], target_out.hidden)  # [B, T, K, V_d]
        return head_losses(logits, batch, [1.0 / self.num_heads] * self.num_heads, draft_vocab=self.draft_vocab)


class _SARNet(nn.Module):
    spec: SemiAutoregressive
    target: ModelConfig

    def setup(self) -> None:
        half = max(1, self.target.hidden_size // 2)
        if self.spec.encoder == "simplified":
            self.token_mlp = [logical_dense(half, ("embed", "mlp"), "mlp_in"),
                              logical_dense(half, ("mlp", None), "mlp_out")]
            self.alpha_logits = self.param("alpha_logits", nn.initializers.zeros_init(), (self.spec.num_heads,))
        else:
            self.cells = [nn.OptimizedLSTMCell(half, name=f"lstm{i}") for i in range(2)]
        width = self.spec.branch_width(self.target)
        self.w_p = logical_dense(width, ("embed", "mlp"), "w_p")  # its bias is b3's first half
        self.w_q = logical_dense(width, (None, "mlp"), "w_q")  # and this one's the second

    def __call__(self, hidden: jax.Array, path: jax.Array) -> jax.Array:
        """Whole sequences (training, init): hidden `[B, T, D]`, path embeddings `[B, T, K, D]` (e of tokens
        t + 1 .. t + K) -> q0's hidden features `[B, T, K, 2W]`, depth j's from the path's first j + 1 tokens."""
        carry, distant = self.empty(path.shape[:2]), self.w_p(hidden)
        features = []
        for j in range(path.shape[2]):
            carry = self.step(carry, path[:, :, j], j)
            features.append(self.combine(distant, carry))
        return jnp.stack(features, axis=2)

    def empty(self, shape: tuple[int, ...]) -> Carry:
        """The encoder state over an empty path, `shape` paths."""
        half = max(1, self.target.hidden_size // 2)
        zeros = jnp.zeros(shape + (half,), jnp.float32)
        if self.spec.encoder == "simplified":
            return {"sum": zeros, "weight": jnp.zeros(shape + (1,), jnp.float32)}  # Eq. 6's numerator, denominator
        return tuple((zeros, zeros) for _ in self.cells)  # (c, h) of each LSTM layer

    def step(self, carry: Carry, embeds: jax.Array, position: int) -> Carry:
        """The state after one more token, given its embedding `[..., D]` at path position `position`."""
        if self.spec.encoder == "simplified":
            alpha = jax.nn.sigmoid(self.alpha_logits[position])
            token = self.token_mlp[1](nn.silu(self.token_mlp[0](embeds)))  # [..., H/2]
            return {"sum": carry["sum"] + alpha * token, "weight": carry["weight"] + alpha}
        layers, x = [], embeds
        for cell, layer_carry in zip(self.cells, carry, strict=True):
            layer_carry, x = cell(layer_carry, x)
            layers.append(layer_carry)
        return tuple(layers)

    def encoded(self, carry: Carry) -> jax.Array:
        """h_q `[..., H/2]` of a non-empty path."""
        if self.spec.encoder == "simplified":
            return carry["sum"] / carry["weight"]
        return carry[-1][1]

    def mix(self, hidden: jax.Array, carry: Carry) -> jax.Array:
        """q0's hidden layer: act(concat(Wp^T h_p, Wq^T h_q) + b3) -> `[..., 2W]`; `hidden [..., D]` broadcasts over
        the paths (one base state per row, many paths)."""
        return self.combine(self.w_p(hidden), carry)

    def combine(self, distant: jax.Array, carry: Carry) -> jax.Array:
        """`mix` given `Wp^T h_p + b` (`distant [..., W]`, broadcast over the paths)."""
        recent = self.w_q(self.encoded(carry))
        return nn.silu(jnp.concatenate([jnp.broadcast_to(distant, recent.shape), recent], axis=-1))
