"""Rotary position embeddings (HF `rotate_half` layout) with default, linear and Llama-3 scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies `[head_dim // 2]` (fp64 on host, like the HF reference)."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    s = config.rope_scaling
    if s.rope_type == "linear":
        inv = inv / s.factor
    elif s.rope_type == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * inv / s.factor + smooth * inv
        inv = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(is_medium, smoothed, inv)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate `x [B, T, H, Dh]` by `positions [B, T]`; computed in fp32, returned in x's dtype."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, T, Dh/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
