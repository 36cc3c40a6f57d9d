"""Token selection: greedy, and temperature / top-k / top-p sampling with an explicit PRNG key."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.infra.errors import DecodeSpecError


def is_whole(value: object) -> bool:
    """An integer (numpy's included), not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Static (hashable) sampling settings. `temperature == 0` is greedy; `top_k == 0` and `top_p == 1`
    disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        """The one home of the sampling settings' ranges (NaN fails every rule); a `DecodeSpecError` names the bad
        one. Values are kept as float / int / float."""
        for name, ok, rule in (("temperature", lambda v: v >= 0, "must be >= 0 (0 = greedy)"),
                               ("top_k", lambda v: is_whole(v) and v >= 0, "must be a whole number >= 0 (0 = off)"),
                               ("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")):
            value = getattr(self, name)
            try:
                good = not isinstance(value, bool) and ok(value) and value == value
            except TypeError:
                good = False
            if not good:
                raise DecodeSpecError(name, value, rule)
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float)):
            object.__setattr__(self, name, kind(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Temperature, then top-k, then top-p over `logits [..., V]` (fp32); filtered entries become -inf.

    `softmax(warp_logits(l))` is the distribution that sampling draws from (and that lossless
    verification must preserve).
    """
    logits = logits.astype(jnp.float32) / max(cfg.temperature, 1e-6)
    neg_inf = jnp.float32(-jnp.inf)
    if cfg.top_k > 0:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, neg_inf, logits)
    if cfg.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        keep_sorted = before < cfg.top_p  # the top token is always kept
        keep = jnp.zeros_like(keep_sorted).at[
            tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
        logits = jnp.where(keep, logits, neg_inf)
    return logits


def select_token(logits: jax.Array, rng: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Next token `[...]` from `logits [..., V]`: argmax when greedy, else a sample."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, warp_logits(logits, cfg), axis=-1).astype(jnp.int32)
