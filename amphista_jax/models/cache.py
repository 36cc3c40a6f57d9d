"""The fixed-size KV cache shared by the target model and every draft method that keeps its own cache.

Layout: `k, v [layers, B, S, kv_heads, head_dim]` with `S = max_len + tree_pad`, and `lengths [B]`, the
number of committed tokens per row. Slot `s < lengths[b]` holds the committed token at position `s`. A
forward over `T` new tokens writes their keys/values to the scratch slots `[lengths, lengths + T)` and
leaves `lengths` alone: the caller commits with `advance` (prefill, AR steps) or `compact` (tree paths).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

CACHE_AXES = ("layers", "batch", "length", "kv_heads", None)  # logical axes of `k` and `v`


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, KVH, Dh]
    v: jax.Array  # [L, B, S, KVH, Dh]
    lengths: jax.Array  # [B] int32

    @classmethod
    def zeros(cls, num_layers: int, batch: int, size: int, kv_heads: int, head_dim: int,
              dtype: jnp.dtype = jnp.float32) -> KVCache:
        shape = (num_layers, batch, size, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def size(self) -> int:
        return self.k.shape[2]

    def advance(self, n: jax.Array) -> KVCache:
        """Commit `n [B]` (or a scalar) scratch tokens that were written in slot order."""
        return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))


def write(layer_cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write `new [B, T, KVH, Dh]` into `layer_cache [B, S, KVH, Dh]` at per-row slot `start [B]`.

    The caller guarantees `start + T <= S` (`dynamic_update_slice` would otherwise clamp and shift).
    """
    def one(c: jax.Array, n: jax.Array, s: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (s, 0, 0))

    return jax.vmap(one)(layer_cache, new, start)


def write_layer(cache: jax.Array, new: jax.Array, start: jax.Array, layer: jax.Array | int) -> jax.Array:
    """`write` into layer `layer` of a whole cache `[L, B, S, KVH, Dh]`, which XLA updates in place (a written
    slice of it would be a copy)."""
    b, t = new.shape[:2]
    slots = start[:, None] + jnp.arange(t, dtype=start.dtype)[None]  # [B, T]
    return cache.at[layer, jnp.arange(b)[:, None], slots].set(new.astype(cache.dtype), mode="promise_in_bounds")


def compact(cache: KVCache, accepted_slots: jax.Array, n_accepted: jax.Array) -> KVCache:
    """Move accepted scratch entries to the committed region and commit them.

    `accepted_slots [B, D + 1]` holds, per row, the scratch offsets (relative to `lengths`) of the accepted
    tokens in order; entries past `n_accepted [B]` are ignored. Afterwards the accepted tokens occupy slots
    `[lengths, lengths + n_accepted)` and `lengths` grows by `n_accepted`.
    """
    depth = accepted_slots.shape[1]
    lengths = cache.lengths

    def move(layer: jax.Array) -> jax.Array:  # [B, S, KVH, Dh]
        src = lengths[:, None] + jnp.maximum(accepted_slots, 0)  # [B, D]
        gathered = jnp.take_along_axis(layer, src[:, :, None, None], axis=1)  # [B, D, KVH, Dh]
        current = jax.vmap(lambda c, s: jax.lax.dynamic_slice_in_dim(c, s, depth, 0))(layer, lengths)
        keep = (jnp.arange(depth)[None, :] < n_accepted[:, None])[:, :, None, None]
        return write(layer, jnp.where(keep, gathered, current), lengths)

    return KVCache(jax.vmap(move)(cache.k), jax.vmap(move)(cache.v), lengths + n_accepted.astype(jnp.int32))


def constrain_caches(tree: Any) -> Any:
    """Every `KVCache` in `tree` (a cache itself, or a drafter's state) under logical-axis constraints
    (`CACHE_AXES`: rows over the batch axes, KV heads over `tensor` by `sharding.LOGICAL_RULES`); a no-op outside a
    mesh and rules context."""
    def one(c: KVCache) -> KVCache:
        return KVCache(nn.with_logical_constraint(c.k, CACHE_AXES), nn.with_logical_constraint(c.v, CACHE_AXES),
                       nn.with_logical_constraint(c.lengths, ("batch",)))

    is_cache = lambda x: isinstance(x, KVCache)  # noqa: E731
    return jax.tree.map(lambda x: one(x) if is_cache(x) else x, tree, is_leaf=is_cache)
