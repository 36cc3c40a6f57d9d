"""Flash attention's arithmetic, as the tree-attention kernel runs it inside each program (`tree_attention.py`).

A program folds blocks of keys one at a time into a running (max `m`, denominator `l`, unnormalised output `acc`)
per query row (`online_softmax_step`), all fp32; flash-decoding's splits each hold such a partial over their run of
blocks, merged afterwards into the softmax-weighted values (`combine_splits`). Products accumulate in fp32 whatever
the inputs' dtype (`dot_nt`). A row that sees no key keeps `m = -inf` and gets a zero output, not NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = -jnp.inf


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b.T with fp32 accumulation: [M, D] x [N, D] -> [M, N]."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a @ b with fp32 accumulation: [M, N] x [N, D] -> [M, D]."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def online_softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],  # m [R, 1], l [R, 1], acc [R, Dh], all fp32
    scores: jax.Array,  # [R, N] fp32, may hold NaN where not visible
    visible: jax.Array,  # [R, N] bool
    v: jax.Array,  # [N, Dh], finite (masked rows already zeroed)
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one block of keys into the running (max, sum, weighted values) of a flash-style softmax."""
    m_prev, l_prev, acc_prev = carry
    scores = jnp.where(visible, scores, NEG_INF)  # before any arithmetic: drops NaN from unused slots
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    m_safe = jnp.where(m_next == NEG_INF, 0.0, m_next)  # all masked so far: avoid -inf - -inf
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.where(visible, jnp.exp(scores - m_safe), 0.0)  # [R, N]
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc_next = alpha * acc_prev + _dot_nn(p.astype(v.dtype), v)
    return m_next, l_next, acc_next


def combine_splits(
    m: jax.Array,  # [..., P, R, 1] fp32: each split's running max (-inf where it saw nothing)
    denom: jax.Array,  # [..., P, R, 1] fp32
    acc: jax.Array,  # [..., P, R, Dh] fp32
) -> jax.Array:  # [..., R, Dh] fp32
    """Merge the splits' online-softmax partials into the softmax-weighted values (0 for a row that saw nothing)."""
    m_max = jnp.max(m, axis=-3, keepdims=True)
    weight = jnp.exp(m - jnp.where(m_max == NEG_INF, 0.0, m_max))  # exp(-inf) = 0 for an empty split
    total = jnp.sum(weight * denom, axis=-3)
    return jnp.sum(weight * acc, axis=-3) / jnp.where(total == 0.0, 1.0, total)
