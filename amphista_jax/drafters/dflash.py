"""DFlash (z-lab, 2025-2026): a block of draft tokens from one non-causal forward of a few draft layers that attend
to features fused from several target layers.

Features: the outputs of `target_layer_ids` (the reference's `round(1 + i (L - 4) / (n - 1))` for n = the number of
draft layers: SmolLM2's 30 layers give 1, 8, 14, 20, 27), i.e. the inputs of the layers after them
(`Drafter.captured_layers`, `Output.captured [B, T, C * D]`, kept by the target's prefill and verify forwards as
EAGLE-3's are), concatenated and fused by `fc: C D -> D` (no bias) and `hidden_norm` into one context vector per
committed position.

The draft layers are decoder layers of the target's width (the reference's Qwen3 layers: `q_norm`/`k_norm` on each
head, `qk_norm`; no biases) whose attention reads, besides the block's own keys and values, every layer's own
`k_proj`/`v_proj` of the context vectors of the committed positions before the block (RoPE at their positions; the
context skips `input_layernorm`). Those context keys/values are the drafter's cache: `prefill` writes the prompt's,
`commit` the accepted path's. The block is `[root, MASK x (B - 1)]` at positions `lengths .. lengths + B - 1`,
every slot seeing every other (no causal mask); the root is the target's last token, whose features come with
the next verify. `norm` and the target's frozen `lm_head` (its `draft_vocab` columns) turn slot k's output into
the distribution of the token at depth k: one forward drafts every depth. MASK is a learned embedding, initialised
from the target's embedding of `mask_token_id` (-1: the mean embedding); with `learned_mask=False` it is that
embedding itself, untrained and not a parameter (the reference's form: an unused token of the target's vocabulary).

Trees: chains (`chain-k`) and any static tree of per-depth top-k (Medusa's, BiTA's efficient trees, searched trees)
up to depth B - 1; at `temperature > 0` (`sampling_at`) every node is drawn from its depth's distribution and passed
as `q` to lossless rejection sampling (`base.sampled_proposal`).

Training (the reference's SpecForge recipe): per sequence `num_anchors` positions p whose token and next token are
both trained, drawn anew each step; block p is `[x_p, MASK x (B - 1)]` at positions p .. p + B - 1, seeing the
context strictly before p and its own block (all blocks in one forward under one mask). Slot k (1 .. B - 1)
predicts the token at p + k (the data's, or with `loss.labels: target` the target's; `loss.kind: kl`: the KL to the
target's distribution there), weighted `exp(-(k - 1) / gamma)`. Slot k's metrics are `head{k-1}/...`, the depth
every other method's head k - 1 drafts.
"""

from __future__ import annotations

import dataclasses
import math

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
    logical,
    sampled_proposal,
    topk_proposal,
)
from amphista_jax.drafters.causal_layers import at_path, block_config
from amphista_jax.drafters.draft_vocab import normalise_field, project_columns
from amphista_jax.drafters.losses import batch_labels, head_metrics, target_kl, unstack
from amphista_jax.infra.ranges import setting
from amphista_jax.models.cache import KVCache, write
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import MLP, Output, RMSNorm
from amphista_jax.models.projections import logical_dense
from amphista_jax.models.rope import apply_rope, inverse_frequencies
from amphista_jax.models.target import Target
from amphista_jax.trees.tree import Tree
from amphista_jax.trees.verify import Verdict
from pallas_kernels.dense_attention import dot_product_attention


def reference_layer_ids(num_target_layers: int, num_features: int) -> tuple[int, ...]:
    """The reference's feature layers: `round(1 + i (L - 4) / (n - 1))` for i < n (Python's rounding), the middle
    layer for n = 1; clamped into `0 .. L - 2` for a shallow target (each is the input of a later layer)."""
    top = max(num_target_layers - 2, 0)
    if num_features == 1:
        return (min(num_target_layers // 2, top),)
    span = num_target_layers - 4
    return tuple(min(max(round(1 + i * span / (num_features - 1)), 0), top) for i in range(num_features))


@Drafter.register
@dataclasses.dataclass(frozen=True)
class DFlash(LogicalInit):
    name = "dflash"
    # B: the root and B - 1 draft slots, one forward
    block_size: int = setting(16, ge=2, why="the root and at least one draft slot")
    num_layers: int = setting(5, ge=1, why="draft decoder layers")
    target_layer_ids: tuple[int, ...] = ()  # target layers whose outputs are fused; () = reference_layer_ids
    mask_token_id: int = -1  # the target token whose embedding initialises MASK; -1 = the mean embedding
    learned_mask: bool = True  # False: MASK is the target's embedding of mask_token_id, not trained (the reference's)
    qk_norm: bool = True  # RMSNorm on each query and key head (the reference's Qwen3 layers)
    # slot k's loss weight exp(-(k - 1) / gamma)
    loss_gamma: float = setting(7.0, gt=0, why="the reference's 7 for block_size 16")
    num_anchors: int = setting(16, ge=1, why="training blocks per sequence")
    # > 0: drafts sampled at it, passed as q (set by `sampling_at`)
    temperature: float = setting(0.0, ge=0, why="0 = top-k drafts")
    draft_vocab: tuple[int, ...] = ()  # the candidates' target ids (draft_vocab.py); () = the whole vocabulary

    def __post_init__(self) -> None:
        super().__post_init__()
        normalise_field(self)
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if not self.learned_mask and self.mask_token_id < 0:
            raise ValueError("learned_mask=false needs mask_token_id >= 0: the target token that is MASK")

    @property
    def max_depth(self) -> int:
        """Slot k of the block drafts depth k."""
        return self.block_size - 1

    @property
    def paper_tree(self) -> str:
        """The reference drafts one chain through the whole block."""
        return f"chain-{self.block_size - 1}"

    def layer_ids(self, config: ModelConfig) -> tuple[int, ...]:
        """The target layers whose outputs are fused, checked against the target."""
        ids = self.target_layer_ids or reference_layer_ids(config.num_layers, self.num_layers)
        if not all(0 <= i <= config.num_layers - 2 for i in ids):
            raise ValueError(f"target_layer_ids={list(ids)} must be layers 0 .. {config.num_layers - 2} of the "
                             f"target's {config.num_layers} (the output of each feeds a later layer)")
        return ids

    def captured_layers(self, config: ModelConfig) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.layer_ids(config))  # layer i's output is layer i + 1's input

    def sampling_at(self, temperature: float, tree: Tree) -> DFlash:
        return dataclasses.replace(self, temperature=temperature)

    def _net(self, target: ModelConfig) -> _DFlashNet:
        return _DFlashNet(block_config(target, self.num_layers), self.qk_norm, self.block_size)

    def init_boxed(self, rng: jax.Array, target: Target) -> dict:
        c = target.config
        ids = self.layer_ids(c)
        if self.mask_token_id >= c.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is not a token of the target's {c.vocab_size}")
        x = jnp.zeros((1, self.block_size, c.hidden_size))
        params = self._net(c).init(rng, x, jnp.zeros((1, self.block_size), jnp.int32),
                                   jnp.zeros((1, 1, len(ids) * c.hidden_size)))["params"]
        if not self.learned_mask:
            return params
        mask = (target.embed(jnp.arange(c.vocab_size)).mean(0) if self.mask_token_id < 0
                else target.embed(jnp.asarray(self.mask_token_id)))
        return params | {"mask_embedding": logical(jnp.copy(mask), "embed")}

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> KVCache:
        c = target_config
        return KVCache.zeros(self.num_layers, batch, cache_size, c.num_kv_heads, c.head_dim)

    def _commit(self, params: dict, target: Target, captured: jax.Array, count: jax.Array, cache: KVCache
                ) -> KVCache:
        """Write the context keys/values of committed positions' features `captured [B, T, C D]` after the
        cache's committed prefix and commit `count [B]` of them."""
        net = self._net(target.config)
        t = captured.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
        k, v = net.apply({"params": params}, captured.astype(jnp.float32), positions, method=_DFlashNet.context_kv)
        written = jax.vmap(write, in_axes=(0, 0, None))
        return cache.replace(k=written(cache.k, k.astype(cache.k.dtype), cache.lengths),
                             v=written(cache.v, v.astype(cache.v.dtype), cache.lengths)).advance(count)

    def prefill(self, params: dict, target: Target, prompt: PrefillContext, state: KVCache) -> KVCache:
        t = prompt.prompt.shape[1]
        return self._commit(params, target, prompt.out.captured[:, :t], prompt.lengths, state)

    def commit(self, params: dict, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: KVCache) -> tuple[KVCache, jax.Array]:
        state = self._commit(params, target, at_path(verdict, verify_out.captured), verdict.n_accepted, state)
        return state, accepted_hidden(verdict, verify_out)

    def block_inputs(self, params: dict, target: Target, roots: jax.Array) -> jax.Array:
        """`[..., B, D]` the blocks `[root, MASK x (B - 1)]` of `roots [...]`."""
        mask = (params["mask_embedding"] if self.learned_mask
                else target.embed(jnp.asarray(self.mask_token_id)))  # [D]
        mask = jnp.broadcast_to(mask, roots.shape + (self.block_size - 1,) + mask.shape)
        return jnp.concatenate([target.embed(roots)[..., None, :], mask], axis=-2)

    def decode_params(self, params: dict, target: Target) -> dict:
        """The params with the target's lm_head cut to the draft vocabulary (`lm_head [D, V_d]`), cut once per
        generation instead of in every step's forward."""
        return params | {"lm_head": project_columns(target.lm_head(), self.draft_vocab)} if self.draft_vocab else params

    def logits(self, params: dict, target: Target, out: jax.Array) -> jax.Array:
        """fp32 draft logits `[..., V_d]` of block outputs `[..., D]` (already normed): the target's lm_head (its
        draft-vocabulary columns, from `decode_params` when decoding)."""
        head = params["lm_head"] if "lm_head" in params else project_columns(target.lm_head(), self.draft_vocab)
        return out @ head

    def block_logits(self, params: dict, target: Target, root: jax.Array, cache: KVCache, depth: int) -> jax.Array:
        """One forward of the block after the committed context -> logits `[B, depth, V_d]` of depths 1 ..
        `depth` (every slot is in the forward: each sees all of them)."""
        b, s = root.shape[0], cache.size
        positions = cache.lengths[:, None] + jnp.arange(self.block_size, dtype=jnp.int32)[None]  # [B, Bk]
        sees_context = jnp.arange(s)[None, None, :] < cache.lengths[:, None, None]  # [B, 1, S]
        out = self._net(target.config).apply({"params": params}, self.block_inputs(params, target, root), positions,
                                             cache.k, cache.v, jnp.broadcast_to(sees_context, (b, self.block_size, s)),
                                             method=_DFlashNet.block)
        return self.logits(params, target, out[:, 1: depth + 1])

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        logits = self.block_logits(params, target, ctx.root, ctx.state, max(tree.depth, 1))  # [B, depth, V_d]
        if self.temperature > 0:
            return sampled_proposal(logits, ctx.root, tree, rng, self.temperature, target.config.vocab_size,
                                    self.draft_vocab)
        return topk_proposal(logits, ctx.root, tree, self.draft_vocab)

    def anchors(self, batch: dict) -> tuple[jax.Array, jax.Array]:
        """(`[B, A]` training anchors, `[B, A]` whether each is real): `num_anchors` distinct positions p per
        sequence, uniformly among those whose token and next token are both trained (`loss_mask`), in order;
        fewer where a sequence has fewer (the rest are masked). Drawn from `batch["rng"]` (a train step's), else
        fixed (held-out evaluation)."""
        mask = batch["loss_mask"] > 0
        valid = mask[:, :-1] & mask[:, 1:]  # [B, T - 1]
        rng = batch["rng"] if "rng" in batch else jax.random.key(0)
        score = jnp.where(valid, jax.random.uniform(rng, valid.shape), -1.0)
        top, anchors = jax.lax.top_k(score, min(self.num_anchors, valid.shape[1]))
        order = jnp.argsort(anchors, axis=-1)
        return jnp.take_along_axis(anchors, order, -1).astype(jnp.int32), jnp.take_along_axis(top >= 0, order, -1)

    def draft_logits(self, params: dict, target: Target, tokens: jax.Array, captured: jax.Array, anchors: jax.Array,
                     real: jax.Array) -> jax.Array:
        """Every training block in one forward: `tokens [B, T]`, the target's features `[B, T, C D]`, `anchors`
        and `real [B, A]` -> logits `[B, A, B_k - 1, V_d]`, slot k's (1-based) drafting the token at anchor + k."""
        b, t = tokens.shape
        a, bk = anchors.shape[1], self.block_size
        net = self._net(target.config)
        k, v = net.apply({"params": params}, captured.astype(jnp.float32),
                         jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), method=_DFlashNet.context_kv)
        x = self.block_inputs(params, target, jnp.take_along_axis(tokens, anchors, 1)).reshape(b, a * bk, -1)
        positions = (anchors[..., None] + jnp.arange(bk, dtype=jnp.int32)).reshape(b, a * bk)
        sees_context = (jnp.arange(t)[None, None] < anchors[..., None]) & real[..., None]  # [B, A, T]
        out = net.apply({"params": params}, x, positions, k, v, jnp.repeat(sees_context, bk, 1),
                        method=_DFlashNet.block)
        return self.logits(params, target, out.reshape(b, a, bk, -1)[:, :, 1:])

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output) -> tuple[jax.Array, dict]:
        """`sum_k w_k CE_k / sum_k w_k` over slots k = 1 .. B - 1 with `w_k = exp(-(k - 1) / gamma)`, each slot's
        term the mean over its anchors' trained labels (the KL to the target's distribution with `loss.kind: kl`);
        `target_out` needs the captured features."""
        tokens, mask = batch["tokens"], batch["loss_mask"].astype(jnp.float32)
        t = tokens.shape[1]
        anchors, real = self.anchors(batch)
        logits = self.draft_logits(params, target, tokens, target_out.captured, anchors, real)  # [B, A, Bk-1, V_d]
        labels = batch_labels(batch)
        total, weights, metrics = 0.0, 0.0, {}
        for k, lk in enumerate(unstack(logits, 2), start=1):
            at = anchors + k  # [B, A] the positions slot k drafts
            inside = at < t
            at = jnp.minimum(at, t - 1)
            m = real * inside * jnp.take_along_axis(mask, at, 1)

            def gather(x: jax.Array, shift: int = 0, at: jax.Array = at) -> jax.Array:
                idx = (at - shift).reshape(at.shape + (1,) * (x.ndim - 2))
                return jnp.take_along_axis(x, idx, 1)

            lm, head = head_metrics(lk, gather(labels), m, self.draft_vocab)
            gathered = {name: gather(batch[name], 1) for name in ("label_ids", "label_logp", "label_logits")
                        if name in batch}
            if (kl := target_kl(lk, gathered, 0, m, self.draft_vocab)) is not None:
                lm = head["kl"] = kl
            if "greedy" in batch:  # agreement with the target's own greedy token
                head["agree"] = head_metrics(lk, gather(batch["greedy"]), m, self.draft_vocab)[1]["top1"]
            w = math.exp(-(k - 1) / self.loss_gamma)
            total, weights = total + w * lm, weights + w
            metrics |= {f"head{k - 1}/{name}": value for name, value in head.items()}
        return total / weights, metrics


class _DFlashLayer(nn.Module):
    """A draft decoder layer: pre-norm attention over the context's keys/values and the block's own, then the
    target's MLP type."""

    config: ModelConfig
    qk_norm: bool
    block_size: int

    def setup(self) -> None:
        c = self.config
        init = nn.initializers.normal(0.02)
        self.input_layernorm = RMSNorm(c.rms_norm_eps)
        self.q_proj = logical_dense(c.num_heads * c.head_dim, ("embed", "heads"), "q_proj", init, use_bias=False)
        self.k_proj = logical_dense(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), "k_proj", init,
                                    use_bias=False)
        self.v_proj = logical_dense(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), "v_proj", init,
                                    use_bias=False)
        self.o_proj = logical_dense(c.hidden_size, ("heads", "embed"), "o_proj", init, use_bias=False)
        if self.qk_norm:
            self.q_norm = RMSNorm(c.rms_norm_eps)
            self.k_norm = RMSNorm(c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps)
        self.mlp = MLP(c)

    def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`x [B, T, D]` at `positions [B, T]` -> keys (normed, rotated) and values `[B, T, KVH, Dh]`."""
        c = self.config
        shape = x.shape[:2] + (c.num_kv_heads, c.head_dim)
        k = self.k_proj(x).reshape(shape)
        if self.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, positions, inverse_frequencies(c)), self.v_proj(x).reshape(shape)

    def __call__(self, x: jax.Array, positions: jax.Array, context_k: jax.Array, context_v: jax.Array,
                 sees_context: jax.Array) -> jax.Array:
        """Blocks `x [B, A Bk, D]` (A blocks of `block_size`) -> `[B, A Bk, D]`; each query sees the context's
        keys/values `[B, S, KVH, Dh]` under `sees_context [B, A Bk, S]` and every key of its own block (scored
        `A Bk x Bk`, not the `A Bk x A Bk` of a mask over all blocks)."""
        c = self.config
        b, q_len = x.shape[:2]
        h = self.input_layernorm(x)
        q = self.q_proj(h).reshape(b, q_len, c.num_heads, c.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q, positions, inverse_frequencies(c))
        bk = self.block_size
        # [B, A Bk, KVH, Dh] -> [B, A Bk, Bk, KVH, Dh]: each query's copy of its block's keys (values)
        own_k, own_v = (jnp.repeat(y.reshape(b, q_len // bk, 1, bk, *y.shape[2:]), bk, axis=2).reshape(
            b, q_len, bk, *y.shape[2:]) for y in self.keys_values(h, positions))
        out = dot_product_attention(q, context_k.astype(own_k.dtype), context_v.astype(own_v.dtype), sees_context,
                                    diagonal=(own_k, own_v))
        x = x + self.o_proj(out.reshape(b, q_len, c.num_heads * c.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x))


class _DFlashNet(nn.Module):
    config: ModelConfig  # the target's block type with the draft's layer count
    qk_norm: bool
    block_size: int

    def setup(self) -> None:
        c = self.config
        self.fc = logical_dense(c.hidden_size, ("mlp", "embed"), "fc", nn.initializers.normal(0.02), use_bias=False)
        self.hidden_norm = RMSNorm(c.rms_norm_eps)
        self.layers = [_DFlashLayer(c, self.qk_norm, self.block_size) for _ in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps)

    def __call__(self, x: jax.Array, positions: jax.Array, captured: jax.Array) -> jax.Array:
        """Init only."""
        k, v = self.context_kv(captured, positions[:, :1])
        return self.block(x, positions, k, v, jnp.ones(x.shape[:2] + (1,), bool))

    def context_kv(self, captured: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Target features `[B, T, C D]` at `positions [B, T]` -> every layer's context keys and values `[L, B,
        T, KVH, Dh]` (`hidden_norm(fc(.))`, each layer's own projections)."""
        context = self.hidden_norm(self.fc(captured))
        kv = [layer.keys_values(context, positions) for layer in self.layers]
        return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])

    def block(self, x: jax.Array, positions: jax.Array, context_k: jax.Array, context_v: jax.Array,
              sees_context: jax.Array) -> jax.Array:
        """The layers over blocks `x [B, A Bk, D]` -> normed outputs `[B, A Bk, D]` (context `[L, B, S, KVH,
        Dh]`, `sees_context [B, A Bk, S]`; each block sees itself whole)."""
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, context_k[i], context_v[i], sees_context)
        return self.norm(x)

