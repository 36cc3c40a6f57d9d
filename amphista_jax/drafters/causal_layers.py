"""Drafter-owned causal decoder layers over the committed sequence, each with its own KV cache.

Amphista's staged adaptation layers and Hydra++'s prefix-attention layer are decoder layers of the target's
block type that a drafter runs over every committed position. They stay in sync with the target's cache by
one rule: `prefill` runs them over the padded prompt slots and commits each row's prompt length; `commit`
runs them over the accepted path's `D + 1` slots (a fixed shape) and commits `n_accepted`. What they leave
for the next proposal is their output at the last committed position (the node that produced the root).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from amphista_jax.models.cache import KVCache
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output
from amphista_jax.trees.verify import Verdict

# (positions [B, T], caches) -> (outputs [B, T, ...], caches with the T new tokens in their scratch slots)
RunLayers = Callable[[jax.Array, tuple[KVCache, ...]], tuple[jax.Array, tuple[KVCache, ...]]]


def block_config(target: ModelConfig, num_layers: int) -> ModelConfig:
    """The target's decoder-block type with `num_layers` layers of full attention."""
    return dataclasses.replace(target, num_layers=num_layers, sliding_windows=(0,) * num_layers)


def with_rope_base(target: ModelConfig, rope_theta: float) -> ModelConfig:
    """The target's config with a draft layer's own RoPE base `rope_theta` (0: the target's own)."""
    return dataclasses.replace(target, rope_theta=rope_theta) if rope_theta else target


def layer_caches(target: ModelConfig, count: int, batch: int, cache_size: int) -> tuple[KVCache, ...]:
    """`count` empty one-layer caches of the target's KV shape."""
    one = KVCache.zeros(1, batch, cache_size, target.num_kv_heads, target.head_dim)
    return (one,) * count


def at_last(x: jax.Array, count: jax.Array) -> jax.Array:
    """`x [B, T, ...]` at each row's position `count - 1` -> `[B, ...]`."""
    return x[jnp.arange(x.shape[0]), count - 1]


def at_path(verdict: Verdict, x: jax.Array) -> jax.Array:
    """`[B, D + 1, ...]` per-node values `x [B, N, ...]` of a verify forward at the accepted path's nodes (entries
    past `n_accepted` repeat the root's; callers commit only `n_accepted`)."""
    path = jnp.maximum(verdict.accepted_nodes, 0)
    return jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)


def path_hidden(verdict: Verdict, verify_out: Output) -> jax.Array:
    """`[B, D + 1, D]` the target's hidden states at the accepted path's nodes (`at_path`)."""
    return at_path(verdict, verify_out.hidden)


def run_and_commit(run: RunLayers, caches: tuple[KVCache, ...], t: int,
                   count: jax.Array) -> tuple[jax.Array, tuple[KVCache, ...]]:
    """Run the layers over `t` new positions after each cache's committed prefix, commit the first
    `count [B]` of them, and return the output at position `count - 1` with the advanced caches."""
    positions = caches[0].lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]  # [B, T]
    out, caches = run(positions, caches)
    return at_last(out, count), tuple(c.advance(count) for c in caches)
