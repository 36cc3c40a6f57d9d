"""The Llama-family decoder in Flax Linen (Llama 2/3, Vicuna, Mistral, Qwen2).

One forward serves prefill, single-token decode, tree verification and training:

    model.apply({"params": params}, tokens, positions, cache=None, new_mask=None) -> Output

* `tokens, positions [B, T]`: the new tokens and their absolute positions.
* `cache`: a `KVCache` whose `lengths [B]` committed slots are attended to; the new tokens' keys/values are
  written to slots `[lengths, lengths + T)` (the cache's `lengths` are not advanced). `None` = no cache
  (training): the new tokens attend only to each other.
* `new_mask [B, T, T]`: visibility among the new tokens (a tree mask for verification); `None` = causal.
* `extra_embeds [B, E, D]`: extra queries given as input embeddings, appended after the T tokens (a
  drafter's verify-time extras); `positions` and `new_mask` then cover all `T + E` inputs, and their
  keys/values land in the scratch slots after the T tokens'. `prefix [L, B, Pk, ...]`: per-layer keys and
  values visible to the extras alone (a deep prompt), never written to the cache.

Parameters carry logical axis names (`vocab`, `embed`, `heads`, `kv_heads`, `mlp`, `norm`, `layers`);
`amphista_jax.engine.sharding` maps them to a mesh. Layers are stacked on a leading `layers` axis (`nn.scan`), so
the model compiles once whatever its depth; decoding reads them in the `split_layers` layout (one tree per layer,
each projection's `weight [out, in]`: `param_layout`, `projections`).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from amphista_jax.models.attention import AttentionBackend, causal_mask
from amphista_jax.models.cache import KVCache, write, write_layer
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.param_layout import has_split_layers
from amphista_jax.models.projections import rows_product, target_projection
from amphista_jax.models.rope import apply_rope, inverse_frequencies
from pallas_kernels.dense_attention import apply_window, dot_product_attention, key_visibility
from pallas_kernels.tree_attention import tree_attention

Dtype = Any


@struct.dataclass
class PrefixKV:
    """Per-layer keys/values that some of a forward's queries see besides the cache and the new tokens (a
    deep prompt): no positions are applied to them and they are never written to the cache.

    With `diagonal_k`/`diagonal_v` (training-time test's earlier steps, each query's at its own position), query
    `t` sees the prefix keys under `visible`, its row's J diagonal keys and its own new key, and nothing of the
    cache or the other new tokens (neither the cache's keys nor the new-token mask are read): `t x (Pk + J + 1)`
    scores where a mask over every key would score `t x (Pk + (J + 1) t)`."""

    k: jax.Array  # [L, B, Pk, KVH, Dh]
    v: jax.Array  # [L, B, Pk, KVH, Dh]
    visible: jax.Array  # [B, T, Pk] bool: which of the forward's queries see them
    diagonal_k: jax.Array | None = None  # [L, B, T, J, KVH, Dh]
    diagonal_v: jax.Array | None = None  # [L, B, T, J, KVH, Dh]


@struct.dataclass
class Output:
    hidden: jax.Array  # [B, T, D] last-layer hidden states (after the final norm)
    logits: jax.Array | None  # [B, T, V] fp32, when asked for
    cache: KVCache | None  # the cache with the new tokens written to their scratch slots
    # [B, T, C * D] the inputs of the `captures` layers (the residual stream before each), concatenated in order,
    # when asked for (EAGLE-3's low / middle / high features)
    captured: jax.Array | None = None


class RMSNorm(nn.Module):
    eps: float
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones_init(), ("norm",)),
                           (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * normed.astype(x.dtype)


class Attention(nn.Module):
    config: ModelConfig
    param_dtype: Dtype = jnp.float32
    attention: str = "xla"
    out_major: bool = False  # projections in decoding's layout (`OutMajorDense`)

    @nn.compact
    def __call__(self, x, positions, new_mask, visible, layer_k, layer_v, lengths, window, prefix, index=None):
        c = self.config
        b, t, _ = x.shape
        proj = functools.partial(target_projection, param_dtype=self.param_dtype, out_major=self.out_major)
        q = proj(c.num_heads * c.head_dim, ("embed", "heads"), c.qkv_bias, "q_proj")(x)
        k = proj(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), c.qkv_bias, "k_proj")(x)
        v = proj(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), c.qkv_bias, "v_proj")(x)
        inv_freq = inverse_frequencies(c)
        q = apply_rope(q.reshape(b, t, c.num_heads, c.head_dim), positions, inv_freq)
        k = apply_rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), positions, inv_freq)
        v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
        new_k, new_v = k, v
        if layer_k is not None and layer_k.ndim == 5:  # the whole cache [L, B, S, ...] (`split_layers`): in place
            layer_k, layer_v = write_layer(layer_k, k, lengths, index), write_layer(layer_v, v, lengths, index)
            k, v = layer_k[index].astype(q.dtype), layer_v[index].astype(q.dtype)
        elif layer_k is not None:
            layer_k, layer_v = write(layer_k, k, lengths), write(layer_v, v, lengths)
            k, v = layer_k.astype(q.dtype), layer_v.astype(q.dtype)
        if prefix is not None:  # keys/values that only some queries see: the dense path
            # [B, Pk, Hkv, Dh] x 2, [B, T, Pk], [B, T, J, Hkv, Dh] x 2 or None
            prefix_k, prefix_v, prefix_visible, diagonal_k, diagonal_v = prefix
            if diagonal_k is None:
                out = dot_product_attention(q, jnp.concatenate([k, prefix_k.astype(k.dtype)], 1),
                                            jnp.concatenate([v, prefix_v.astype(v.dtype)], 1),
                                            jnp.concatenate([visible, prefix_visible], -1))
            else:  # the new tokens' own keys join the diagonal ones (PrefixKV)
                out = dot_product_attention(
                    q, prefix_k.astype(q.dtype), prefix_v.astype(q.dtype), prefix_visible,
                    (jnp.concatenate([diagonal_k.astype(q.dtype), new_k[:, :, None]], 2),
                     jnp.concatenate([diagonal_v.astype(q.dtype), new_v[:, :, None]], 2)))
        elif layer_k is not None and self.attention == AttentionBackend.PALLAS:
            out = tree_attention(q, k, v, lengths, new_mask, positions, window, backend="pallas")
        else:
            out = dot_product_attention(q, k, v, visible)  # [B, T, Hq, Dh]
        out = proj(c.hidden_size, ("heads", "embed"), c.o_bias, "o_proj")(
            out.reshape(b, t, c.num_heads * c.head_dim))
        return out, layer_k, layer_v


class MLP(nn.Module):
    config: ModelConfig
    param_dtype: Dtype = jnp.float32
    out_major: bool = False  # projections in decoding's layout (`OutMajorDense`)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        proj = functools.partial(target_projection, param_dtype=self.param_dtype, out_major=self.out_major)
        gate = proj(c.intermediate_size, ("embed", "mlp"), c.mlp_bias, "gate_proj")(x)
        up = proj(c.intermediate_size, ("embed", "mlp"), c.mlp_bias, "up_proj")(x)
        return proj(c.hidden_size, ("mlp", "embed"), c.mlp_bias, "down_proj")(
            nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block; the scan body. `scanned` is this layer's (k cache, v cache, sliding window, prefix keys, prefix
    values, diagonal prefix keys, diagonal prefix values, index); `shared` is (positions, new mask, visibility,
    distance, lengths, the prefix keys' visibility `[B, T, Pk]` (None: no prefix), the captured layers' indices `[C]`
    (None: none)).

    With captures the scan carries `(x, captured [C, B, T, D])`: layer `index` writes its input into the slots
    whose index it is (`captured_inputs`), so only those C arrays are kept, whatever the depth.

    `fused_input` (EAGLE-3's draft layer): the input is `[E(token) ; feature]` `[B, T, 2D]`; attention reads
    `[input_norm(E) ; hidden_norm(feature)]` and the residual stream starts from the feature. `input_norm=False`
    (EAGLE's released draft layer): attention reads the input as it is."""

    config: ModelConfig
    param_dtype: Dtype = jnp.float32
    attention: str = "xla"
    fused_input: bool = False
    input_norm: bool = True
    out_major: bool = False  # projections in decoding's layout (`OutMajorDense`)

    @nn.compact
    def __call__(self, x, scanned, shared):
        layer_k, layer_v, window, prefix_k, prefix_v, diagonal_k, diagonal_v, index = scanned
        positions, new_mask, visible, distance, lengths, prefix_visible, capture_at = shared
        x, captured = x if isinstance(x, tuple) else (x, None)
        if captured is not None:
            captured = jnp.where((capture_at == index)[:, None, None, None], x[None].astype(captured.dtype), captured)
        c = self.config
        visible = apply_window(visible, distance, window)
        prefix = None if prefix_k is None else (prefix_k, prefix_v, prefix_visible, diagonal_k, diagonal_v)
        attn_in = x
        if self.fused_input:
            embeds, x = jnp.split(x, 2, axis=-1)
            attn_in = jnp.concatenate([RMSNorm(c.rms_norm_eps, self.param_dtype, name="input_norm")(embeds),
                                       RMSNorm(c.rms_norm_eps, self.param_dtype, name="hidden_norm")(x)], axis=-1)
        elif self.input_norm:
            attn_in = RMSNorm(c.rms_norm_eps, self.param_dtype, name="input_norm")(x)
        h, layer_k, layer_v = Attention(c, self.param_dtype, self.attention, self.out_major, name="attn")(
            attn_in, positions, new_mask, visible, layer_k, layer_v, lengths, window, prefix, index)
        x = x + h
        x = x + MLP(c, self.param_dtype, self.out_major, name="mlp")(
            RMSNorm(c.rms_norm_eps, self.param_dtype, name="post_attn_norm")(x))
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        return (x, captured) if captured is not None else x, (layer_k, layer_v)


def decoder_layer(remat: bool, scanned: bool) -> type[nn.Module]:
    """The decoder layer class; with `remat`, one whose activations are recomputed in the backward pass (only
    its input is kept), for a loss that differentiates through the target (BiTA). Under `nn.scan` (`scanned`)
    the loop already keeps XLA from merging the recomputation back, elsewhere `prevent_cse` does."""
    return nn.remat(DecoderLayer, prevent_cse=not scanned) if remat else DecoderLayer


def decoder_stack(config: ModelConfig, param_dtype: Dtype, attention: str, name: str, remat: bool = False,
                  input_norm: bool = True) -> nn.Module:
    """`config.num_layers` decoder layers stacked on a leading `layers` axis (`nn.scan`: one compiled body).

    Draft methods build their own stacks from the target's block type (Amphista's adaptation layers and
    auto-embedding block, Hydra++'s prefix layer) and run them with `run_stack`.
    """
    return nn.scan(
        decoder_layer(remat, scanned=True),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast),
        length=config.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(config, param_dtype, attention, input_norm=input_norm, name=name)


def run_stack(
    layers: nn.Module,
    config: ModelConfig,
    x: jax.Array,  # [B, T, D] inputs of the new tokens
    positions: jax.Array,  # [B, T]
    cache: KVCache | None,
    new_mask: jax.Array | None,  # [B, T, T] bool; None = causal
    prefix: PrefixKV | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Run a `decoder_stack` over T new tokens (see the module docstring for `cache`, `new_mask` and
    `prefix`).

    Returns the last layer's output `[B, T, D]` (before any final norm) and the cache with the new tokens'
    keys/values in its scratch slots (`None` without a cache).
    """
    x, cache, _ = captured_run(layers, config, x, positions, cache, new_mask, prefix)
    return x, cache


def captured_run(layers: nn.Module, config: ModelConfig, x: jax.Array, positions: jax.Array, cache: KVCache | None,
                 new_mask: jax.Array | None, prefix: PrefixKV | None = None, captures: tuple[int, ...] = ()
                 ) -> tuple[jax.Array, KVCache | None, jax.Array | None]:
    """`run_stack` that also returns the inputs of layers `captures` `[B, T, C * D]` (None without any)."""
    b, t = x.shape[:2]
    if new_mask is None:
        new_mask = causal_mask(b, t)
    windows = jnp.asarray(config.sliding_windows, jnp.int32)
    lengths = None if cache is None else cache.lengths
    visible, distance = key_visibility(positions, new_mask, lengths, t if cache is None else cache.size)
    pk, pv, pvis, dk, dv = (None,) * 5 if prefix is None else (prefix.k, prefix.v, prefix.visible, prefix.diagonal_k,
                                                                  prefix.diagonal_v)
    index = jnp.arange(config.num_layers, dtype=jnp.int32)
    scanned = (None if cache is None else cache.k, None if cache is None else cache.v, windows, pk, pv, dk, dv, index)
    captured = None
    if isinstance(layers, nn.Module):
        shared = (positions, new_mask, visible, distance, lengths, pvis, jnp.asarray(captures, jnp.int32))
        carry = (x, jnp.zeros((len(captures),) + x.shape, x.dtype)) if captures else x
        carry, (k, v) = layers(carry, scanned, shared)
        x, captured = carry if captures else (carry, None)
    else:  # one module per layer (`split_layers`): the captured inputs are read as the loop passes them
        # Each layer writes its keys/values into the whole cache `[L, B, S, ...]` at its index, in place, and reads
        # its own slice there: under XLA:CPU a per-layer slice of the cache and a restack of the layers would each
        # copy the whole cache on every decode step (the batch-64 step's largest cost, docs/ar_decode.md).
        shared = (positions, new_mask, visible, distance, lengths, pvis, None)
        caught = {}
        k, v = scanned[:2]
        for i, layer in enumerate(layers):
            caught[i] = x
            x, (k, v) = layer(x, (k, v) + jax.tree.map(lambda a, i=i: a[i], scanned[2:]), shared)
        captured = jnp.stack([caught[i] for i in captures]) if captures else None
    if captured is not None:  # [C, B, T, D] -> [B, T, C * D]
        captured = jnp.moveaxis(captured, 0, -2).reshape(x.shape[:2] + (-1,))
    return x, None if cache is None else cache.replace(k=k, v=v), captured


class Transformer(nn.Module):
    """`attention`: "xla" (dense masked attention) or "pallas" (the tree-attention kernel, for the cached
    decode/verify path; `interpret` mode on CPU). Training (no cache) always uses the dense path."""

    config: ModelConfig
    param_dtype: Dtype = jnp.float32
    attention: str = "xla"
    split: bool = False  # params in the `split_layers` layout: one module per layer, no loop over layers, out-major
    remat: bool = False  # recompute each layer's activations in the backward pass (`decoder_layer`)

    def setup(self) -> None:
        AttentionBackend.parse(self.attention)
        c = self.config
        self.embed = nn.Embed(
            c.vocab_size, c.hidden_size, param_dtype=self.param_dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")))
        if self.split:
            layer = decoder_layer(self.remat, scanned=False)
            self.layers = [layer(c, self.param_dtype, self.attention, out_major=True, name=f"layer_{i}")
                           for i in range(c.num_layers)]
        else:
            self.layers = decoder_stack(c, self.param_dtype, self.attention, name="layers", remat=self.remat)
        self.final_norm = RMSNorm(c.rms_norm_eps, self.param_dtype)
        if not c.tie_word_embeddings:
            self.lm_head = target_projection(c.vocab_size, ("embed", "vocab"), False, "lm_head", self.param_dtype,
                                             self.split)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int
        positions: jax.Array,  # [B, T] int
        cache: KVCache | None = None,
        new_mask: jax.Array | None = None,  # [B, T(+E), T(+E)] bool; None = causal
        return_logits: bool = True,
        extra_embeds: jax.Array | None = None,  # [B, E, D] extra queries after the T tokens
        prefix: PrefixKV | None = None,  # keys/values only the extras see
        captures: tuple[int, ...] = (),  # layers whose inputs `Output.captured` holds
    ) -> Output:
        x = self.embed_tokens(tokens)
        if extra_embeds is not None:
            x = jnp.concatenate([x, extra_embeds.astype(x.dtype)], axis=1)
        x, cache, captured = captured_run(self.layers, self.config, x, positions, cache, new_mask, prefix, captures)
        hidden = self.final_norm(x)
        return Output(hidden, self.logits(hidden) if return_logits else None, cache, captured)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """Input embeddings `[..., D]` of `tokens [...]` (Amphista/Hydra consume these)."""
        return nn.with_logical_constraint(self.embed(tokens), ("batch", "length", "embed"))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """fp32 vocabulary logits `[..., V]` of last-layer hidden states `[..., D]`."""
        if self.config.tie_word_embeddings:
            out = rows_product(self.embed.embedding, hidden)  # the embedding [V, D] is out-major
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)


def target_model(config: ModelConfig, params: dict, attention: str = "xla", remat: bool = False) -> Transformer:
    """The `Transformer` that applies `params` in their layout (stacked or `split_layers`)."""
    return Transformer(config, attention=attention, split=has_split_layers(params), remat=remat)


def init_params(config: ModelConfig, rng: jax.Array, param_dtype: Dtype = jnp.float32) -> dict:
    """Random-init parameters (unboxed arrays)."""
    model = Transformer(config, param_dtype)
    tokens = jnp.zeros((1, 1), jnp.int32)
    return nn.unbox(model.init(rng, tokens, tokens, return_logits=True)["params"])


def param_shapes(config: ModelConfig, param_dtype: Dtype = jnp.float32, split: bool = False) -> tuple[dict, dict]:
    """(`jax.ShapeDtypeStruct` tree, logical-axis `PartitionSpec` tree) of the params, without allocating
    (`split`: in the `split_layers` layout)."""
    model = Transformer(config, param_dtype, split=split)
    tokens = jnp.zeros((1, 1), jnp.int32)
    boxed = jax.eval_shape(lambda r: model.init(r, tokens, tokens)["params"], jax.random.key(0))
    return nn.unbox(boxed), nn.get_partition_spec(boxed)


def new_cache(config: ModelConfig, batch: int, size: int, dtype: Dtype = jnp.float32) -> KVCache:
    return KVCache.zeros(config.num_layers, batch, size, config.num_kv_heads, config.head_dim, dtype)
