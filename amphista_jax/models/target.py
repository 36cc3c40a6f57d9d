"""The target as drafters and the engine see it (`docs/architecture.md`, section 1): `Target(config, params)`,
built once per generation, the `Extras` a drafter may add to a target forward, and the target forward that
carries them. Nothing here knows drafters: the engine (`decode.py`), the trainer and sharding run the target
through this module, and drafters reach the model only through `Target`'s methods."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from amphista_jax.models.cache import KVCache
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output, PrefixKV, Transformer
from amphista_jax.models.param_layout import (
    has_split_layers,
    input_embeddings,
    layer_params,
    out_major,
    output_projection,
)


@struct.dataclass
class Target:
    """The frozen target model a drafter works on: its (static) config and its params. Drafters reach the
    model only through these methods, never by indexing `params`."""

    config: ModelConfig = struct.field(pytree_node=False)
    params: dict

    def embed(self, tokens: jax.Array) -> jax.Array:
        """fp32 input embeddings `[..., D]` of `tokens [...]`."""
        return input_embeddings(self.params, tokens).astype(jnp.float32)

    def lm_head(self) -> jax.Array:
        """The fp32 `[D, V]` vocabulary projection (tied embeddings: the embedding transposed)."""
        return output_projection(self.params).astype(jnp.float32)

    def first_layers(self, n: int) -> dict:
        """The params of a model of the target's first `n` layers, in `split_layers`' layout: its embedding, layers
        `0 .. n - 1`, final norm and projection (a draft model made from the target)."""
        first = {k: v for k, v in self.params.items() if k in ("embed", "final_norm", "lm_head")} | {
            f"layer_{i}": layer_params(self.params, i) for i in range(n)}
        return first if has_split_layers(self.params) else out_major(first)


@struct.dataclass
class Extras:
    """Extra queries a drafter adds to a target forward (BiTA's mask tokens), given as input embeddings.

    They see the committed prefix, the forward's new tokens they are given (`sees_new`: the tree's nodes at
    verification, the prompt's slots at prefill) and each other (`sees_extras`), plus optional per-layer
    prefix keys/values that nothing else sees. The new tokens never see them, and their keys/values are never
    committed to the cache. Their hidden states follow the new tokens' in the forward's output.
    """

    embeds: jax.Array  # [B, E, D]
    positions: jax.Array  # [B, E]
    sees_new: jax.Array  # [B, E, T] bool
    sees_extras: jax.Array  # [B, E, E] bool
    prefix_k: jax.Array | None = None  # [L, B, Pk, KVH, Dh]
    prefix_v: jax.Array | None = None  # [L, B, Pk, KVH, Dh]

    @property
    def count(self) -> int:
        return self.embeds.shape[1]


def forward(model: Transformer, params: dict, tokens: jax.Array, positions: jax.Array, cache: KVCache | None,
            new_mask: jax.Array, extras: Extras | None, return_logits: bool = True,
            captures: tuple[int, ...] = ()) -> Output:
    """The target over `tokens [B, T]` at `positions [B, T]` with visibility `new_mask [B, T, T]` among them, plus
    a drafter's `extras` after them: the output's hidden states (and logits) are `[B, T + E, ...]`, the new
    tokens' first. The tokens never see the extras; the extras see the committed prefix, `extras.sees_new`,
    `extras.sees_extras` and their own prefix keys/values. Decoding's forwards (`decode.prefill`, verification)
    and a loss that runs the target with extras (BiTA's, without a cache) share it. `captures`: the layers whose
    inputs `Output.captured` holds (a drafter's `captured_layers`)."""
    if extras is None:
        return model.apply({"params": params}, tokens, positions, cache, new_mask, return_logits, captures=captures)
    b, t = tokens.shape
    e = extras.count
    mask = jnp.concatenate([jnp.concatenate([new_mask, jnp.zeros((b, t, e), bool)], 2),
                            jnp.concatenate([extras.sees_new, extras.sees_extras], 2)], 1)  # [B, T + E, T + E]
    prefix = None
    if extras.prefix_k is not None:
        visible = jnp.broadcast_to((jnp.arange(t + e) >= t)[None, :, None], (b, t + e, extras.prefix_k.shape[2]))
        prefix = PrefixKV(extras.prefix_k, extras.prefix_v, visible)
    return model.apply({"params": params}, tokens, jnp.concatenate([positions, extras.positions], 1), cache, mask,
                       return_logits, extras.embeds, prefix, captures)
