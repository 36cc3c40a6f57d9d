"""Attention over a KV cache without a kernel: which key slots each new token sees (pure functions of positions
and lengths) and dense masked attention. The model's XLA path and the reference of the tree-attention kernel
(`tree_attention.py`) both use these; nothing here imports `amphista_jax`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def key_visibility(
    positions: jax.Array,  # [B, T] positions of the new tokens
    new_mask: jax.Array,  # [B, T, T] visibility among the new tokens
    lengths: jax.Array | None,  # [B] committed tokens in the cache, or None when there is no cache
    num_keys: int,  # S: cache slots (or T without a cache)
) -> tuple[jax.Array, jax.Array]:
    """(`visible [B, T, S]` bool, `distance [B, T, S]` query position - key position) for each key slot.

    With a cache, slot `s < lengths` is a committed token at position `s` (always visible); slot
    `lengths + j` is new token `j` (visible where `new_mask[:, :, j]`); later slots are never visible.
    Without a cache the keys are the new tokens themselves. A sliding window then keeps
    `distance < window` (`apply_window`), per layer.
    """
    if lengths is None:
        visible, key_pos = new_mask, positions
    else:
        slots = jnp.arange(num_keys)[None, :]  # [1, S]
        rel = slots - lengths[:, None]  # [B, S] offset into the new tokens
        is_new = (rel >= 0) & (rel < new_mask.shape[-1])
        rel_c = jnp.clip(rel, 0, new_mask.shape[-1] - 1)
        new_visible = jnp.take_along_axis(new_mask, jnp.broadcast_to(rel_c[:, None, :], new_mask.shape[:2] +
                                                                      (num_keys,)), axis=2)
        visible = (rel < 0)[:, None, :] | (is_new[:, None, :] & new_visible)
        key_pos = jnp.where(rel < 0, slots, jnp.take_along_axis(positions, rel_c, axis=1))  # [B, S]
    return visible, positions[:, :, None] - key_pos[:, None, :]


def apply_window(visible: jax.Array, distance: jax.Array, window: jax.Array | int) -> jax.Array:
    """Restrict `visible [B, T, S]` to keys less than `window` positions back (0 = full attention)."""
    return visible & ((window == 0) | (distance < window))


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                          diagonal: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Grouped-query attention, fp32 scores and softmax.

    q: [B, T, Hq, Dh]; k, v: [B, S, Hkv, Dh]; visible: [B, T, S] bool -> [B, T, Hq, Dh]. The values of slots no
    query sees are zeroed and every hidden slot's score is masked, so garbage (even NaN) in unused cache slots
    cannot reach the output; a query that sees nothing gets zeros.

    `diagonal` (keys, values `[B, T, J, Hkv, Dh]`): J more keys per query that query `t` alone sees, in the
    same softmax: scored as `T x J` instead of the `T x T J` a mask over all of them would score.
    """
    b, t, hq, dh = q.shape
    s, hkv = k.shape[1:3]
    g = hq // hkv
    # A KV head's G query heads and the T queries share one row axis M = G x T: one [M, Dh] x [Dh, S] product per
    # KV head, which XLA:CPU runs faster than the products batched over (KV head, G) with T rows each.
    qg = q.reshape(b, t, hkv, g, dh)
    qm = qg.transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, dh)  # [B, Hkv, M, Dh]
    used = jnp.any(visible, axis=1)[:, :, None, None]  # [B, S, 1, 1]
    kt = k.transpose(0, 2, 1, 3)  # [B, Hkv, S, Dh]; unused slots' scores are masked below
    vt = jnp.where(used, v, jnp.zeros((), v.dtype)).transpose(0, 2, 1, 3)  # [B, Hkv, S, Dh]
    scale = jnp.sqrt(jnp.float32(dh))
    scores = jnp.einsum("BKMD,BKSD->BKMS", qm, kt, preferred_element_type=jnp.float32).reshape(
        b, hkv, g, t, s) / scale  # [B, Hkv, G, T, S]
    mask = visible[:, None, None]  # [B, 1, 1, T, S]
    if diagonal is not None:
        own = jnp.einsum("BTKGD,BTJKD->BKGTJ", qg, diagonal[0], preferred_element_type=jnp.float32) / scale
        scores = jnp.concatenate([scores, own], -1)  # [B, Hkv, G, T, S + J]
        mask = jnp.concatenate([mask, jnp.ones(mask.shape[:-1] + own.shape[-1:], bool)], -1)
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("BKMS,BKSD->BKMD", probs[..., :s].reshape(b, hkv, g * t, s).astype(v.dtype), vt,
                     preferred_element_type=jnp.float32).reshape(b, hkv, g, t, dh)
    if diagonal is not None:
        out = out + jnp.einsum("BKGTJ,BTJKD->BKGTD", probs[..., s:].astype(v.dtype), diagonal[1],
                               preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq, dh).astype(q.dtype)
