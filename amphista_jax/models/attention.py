"""The choice of attention backend for cached forwards, and the causal mask of prefill and training.

The masks over a KV cache (`key_visibility`, `apply_window`) and the dense attention (`dot_product_attention`,
the XLA path and the kernel's reference) live beside the kernel in `pallas_kernels/dense_attention.py`, which
imports nothing from this package."""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from amphista_jax.infra.errors import UsageError


class AttentionBackend(enum.StrEnum):
    """How cached forwards (decode, verify) attend; training always uses the dense path."""

    XLA = "xla"  # dense masked attention (`dot_product_attention`)
    PALLAS = "pallas"  # the tree-attention kernel (`pallas_kernels/tree_attention.py`; interpreted on CPU)

    @classmethod
    def parse(cls, name: str) -> AttentionBackend:
        try:
            return cls(name)
        except ValueError:
            raise UsageError(f"attention {name!r} must be one of {', '.join(cls)}") from None


def causal_mask(batch: int, t: int) -> jax.Array:
    """`[B, T, T]` lower-triangular visibility among T new tokens.

    For T = 3 each row is::

        1 0 0
        1 1 0
        1 1 1
    """
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))
