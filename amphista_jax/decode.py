"""Generation: prefill, then a `lax.while_loop` of steps, all inside one `jax.jit` with static shapes.

`generate` is the autoregressive baseline every speed-up is measured against. Shapes are fixed by
(batch, prompt_len, cache_size, max_new_tokens), so a new batch of prompts of the same padded shape
reuses the compiled program. Rows of a batch have their own prompt lengths (`prompt_lengths [B]`): the
prompts are right-padded and each row continues from its own length, with no re-padding.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from amphista_jax.cache import KVCache
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output, Transformer, new_cache
from amphista_jax.sampling import SamplingConfig, select_token

GREEDY = SamplingConfig()


class PromptTooLongError(ValueError):
    """A prompt that does not fit in the cache together with the tokens to generate."""


@struct.dataclass
class GenerateOutput:
    tokens: jax.Array  # [B, max_new_tokens] generated tokens, `pad_id` after a row stops
    num_tokens: jax.Array  # [B] tokens generated per row (an EOS token counts and is included)
    steps: jax.Array  # [] target forward passes after the prefill


@struct.dataclass
class _LoopState:
    cache: KVCache
    last: jax.Array  # [B] the token to feed next
    tokens: jax.Array  # [B, max_new_tokens]
    num_tokens: jax.Array  # [B]
    done: jax.Array  # [B] bool
    steps: jax.Array  # []
    rng: jax.Array


def pad_prompts(prompts: Sequence[Sequence[int]], length: int | None = None, pad_id: int = 0,
                multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to `[B, length]` (default: the longest, rounded up to `multiple` so that
    similar batches share one compiled program). Returns (tokens [B, T] int32, lengths [B] int32)."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS)")
    longest = int(lengths.max())
    length = length or -(-longest // multiple) * multiple
    if longest > length:
        raise PromptTooLongError(f"prompt of {longest} tokens does not fit the padded length {length}")
    out = np.full((len(prompts), length), pad_id, np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, lengths


def check_fits(prompt_lengths: np.ndarray, max_new_tokens: int, cache_size: int) -> None:
    """Raise `PromptTooLongError` unless every prompt plus `max_new_tokens` fits in `cache_size` slots."""
    longest = int(np.max(prompt_lengths))
    if longest + max_new_tokens > cache_size:
        raise PromptTooLongError(
            f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} needs {longest + max_new_tokens} "
            f"cache slots but the cache has {cache_size}: shorten the prompt, lower --max-new-tokens or raise "
            "--max-len")


def prefill(
    model: Transformer, params: dict, prompt: jax.Array, prompt_lengths: jax.Array, cache: KVCache
) -> tuple[Output, KVCache, jax.Array]:
    """Run the padded prompts `[B, T]` through the model; commit each row's own length.

    Returns (output over all prompt slots, committed cache, fp32 logits at each row's last prompt token
    `[B, V]`).
    """
    b, t = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = model.apply({"params": params}, prompt, positions, cache, return_logits=False)
    last_hidden = jnp.take_along_axis(out.hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = model.apply({"params": params}, last_hidden, method=Transformer.logits)
    cache = out.cache.replace(lengths=prompt_lengths.astype(jnp.int32))
    return out, cache, logits


def is_stop(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """`[...]` bool: which tokens are one of `eos_ids`."""
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return (tokens[..., None] == jnp.asarray(eos_ids, tokens.dtype)).any(-1)


@functools.partial(
    jax.jit, static_argnames=("config", "max_new_tokens", "cache_size", "sampling", "eos_ids", "pad_id"))
def generate(
    params: dict,
    prompt: jax.Array,  # [B, T] right-padded prompts
    prompt_lengths: jax.Array,  # [B]
    rng: jax.Array,
    *,
    config: ModelConfig,
    max_new_tokens: int,
    cache_size: int,
    sampling: SamplingConfig = GREEDY,
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
) -> GenerateOutput:
    """Autoregressive generation of up to `max_new_tokens` per row; a row stops after an EOS token.

    The caller checks `check_fits(prompt_lengths, max_new_tokens, cache_size)` first (`generate` runs
    on device and cannot raise on traced lengths); `cache_size >= prompt.shape[1]` is checked here.
    """
    b, t = prompt.shape
    if t > cache_size:
        raise PromptTooLongError(f"padded prompt length {t} exceeds {cache_size=}")
    model = Transformer(config)
    dtype = jax.tree.leaves(params)[0].dtype
    _, cache, logits = prefill(model, params, prompt, prompt_lengths, new_cache(config, b, cache_size, dtype))
    first = select_token(logits, jax.random.fold_in(rng, 0), sampling)
    state = _LoopState(
        cache=cache,
        last=first,
        tokens=jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first),
        num_tokens=jnp.ones((b,), jnp.int32),
        done=is_stop(first, eos_ids) | (max_new_tokens <= 1),
        steps=jnp.zeros((), jnp.int32),
        rng=rng,
    )

    def cond(s: _LoopState) -> jax.Array:
        return ~jnp.all(s.done)

    def body(s: _LoopState) -> _LoopState:
        positions = s.cache.lengths[:, None]
        out = model.apply({"params": params}, s.last[:, None], positions, s.cache)
        nxt = select_token(out.logits[:, 0], jax.random.fold_in(s.rng, s.steps + 1), sampling)
        nxt = jnp.where(s.done, pad_id, nxt)
        tokens = jax.vmap(lambda row, i, tok: row.at[i].set(tok, mode="drop"))(
            s.tokens, jnp.where(s.done, max_new_tokens, s.num_tokens), nxt)
        num_tokens = s.num_tokens + (~s.done)
        done = s.done | is_stop(nxt, eos_ids) | (num_tokens >= max_new_tokens)
        return _LoopState(out.cache.advance(~s.done), nxt, tokens, num_tokens, done, s.steps + 1, s.rng)

    final = jax.lax.while_loop(cond, body, state)
    return GenerateOutput(final.tokens, final.num_tokens, final.steps)
