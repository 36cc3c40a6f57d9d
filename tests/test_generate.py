"""Generation: per-row lengths, EOS stops, one compile, sampling filters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.engine.decode import generate, pad_prompts
from amphista_jax.engine.prompt_checks import PromptTooLongError, check_fits
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import init_params
from amphista_jax.models.param_layout import split_layers
from amphista_jax.trees.sampling import SamplingConfig, select_token, warp_logits

CONFIG = tiny_llama_config()
PROMPTS = [[5, 9, 33, 8, 1, 77, 4, 3, 100], [11, 12], [200, 1, 2, 3, 4]]


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.key(0))


def _gen(params, prompts, **kw):
    tokens, lengths = pad_prompts(prompts)
    kw = dict(config=CONFIG, max_new_tokens=16, cache_size=48) | kw
    return generate(params, tokens, lengths, jax.random.key(3), **kw)


def test_batch_rows_equal_their_own_batch_of_one(params):
    batched = _gen(params, PROMPTS)
    for row, prompt in enumerate(PROMPTS):
        alone = _gen(params, [prompt])
        np.testing.assert_array_equal(np.asarray(batched.tokens[row]), np.asarray(alone.tokens[0]))


def test_sampled_batch_rows_are_reproducible(params):
    cfg = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)
    a, b = _gen(params, PROMPTS, sampling=cfg), _gen(params, PROMPTS, sampling=cfg)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(_gen(params, PROMPTS).tokens))


def test_rows_stop_at_eos_and_pad_after(params):
    free = np.asarray(_gen(params, PROMPTS).tokens)
    eos = int(free[0, 5])  # make row 0's sixth greedy token the EOS
    out = _gen(params, PROMPTS, eos_ids=(eos,), pad_id=-1)
    for row in range(len(PROMPTS)):
        hits = np.flatnonzero(free[row] == eos)
        n = int(hits[0]) + 1 if len(hits) else 16
        assert int(out.num_tokens[row]) == n
        np.testing.assert_array_equal(np.asarray(out.tokens[row, :n]), free[row, :n])
        assert (np.asarray(out.tokens[row, n:]) == -1).all()


def test_generation_compiles_once(params):
    compiles = []

    def listener(event: str, duration: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        tokens, lengths = pad_prompts(PROMPTS, length=16)
        kw = dict(config=CONFIG, max_new_tokens=64, cache_size=96)
        out = generate(params, tokens, lengths, jax.random.key(0), **kw)
        jax.block_until_ready(out)
        assert int(out.steps) == 63 and out.num_tokens.tolist() == [64, 64, 64]
        assert len(compiles) == 1
        other, other_lengths = pad_prompts([[1, 2, 3], [4] * 16, [9, 9]], length=16)
        jax.block_until_ready(generate(params, other, other_lengths, jax.random.key(1), **kw))
        assert len(compiles) == 1
    finally:
        jax.monitoring.clear_event_listeners()


def test_per_layer_layout_generates_the_same_tokens(params):
    """`split_layers(params)` (one module per layer: decoding's layout) == the scanned stack, greedy."""
    tokens, lengths = pad_prompts(PROMPTS)
    kw = dict(config=CONFIG, max_new_tokens=16, cache_size=48)
    stacked = generate(params, tokens, lengths, jax.random.key(0), **kw)
    split = generate(split_layers(params), tokens, lengths, jax.random.key(0), **kw)
    np.testing.assert_array_equal(np.asarray(split.tokens), np.asarray(stacked.tokens))
    np.testing.assert_array_equal(np.asarray(split.num_tokens), np.asarray(stacked.num_tokens))


def test_prompt_longer_than_cache_is_an_error():
    _, lengths = pad_prompts([[1] * 40])
    with pytest.raises(PromptTooLongError, match="needs 56 cache slots but the cache has 48"):
        check_fits(lengths, 16, 48)


def test_top_k_and_top_p_filters():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept_k = jnp.isfinite(warp_logits(logits, SamplingConfig(1.0, top_k=2)))
    assert kept_k.tolist() == [[True, True, False, False, False]]
    kept_p = jnp.isfinite(warp_logits(logits, SamplingConfig(1.0, top_p=0.8)))
    assert kept_p.tolist() == [[True, True, True, False, False]]  # 0.5 + 0.2 < 0.8 -> third is needed


def test_sampling_frequencies_follow_the_distribution():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    keys = jax.random.split(jax.random.key(0), 20000)
    draws = jax.vmap(lambda k: select_token(jnp.log(jnp.asarray(probs)), k, SamplingConfig(1.0)))(keys)
    freq = np.bincount(np.asarray(draws), minlength=4) / len(keys)
    np.testing.assert_allclose(freq, probs, atol=0.015)


def test_invalid_sampling_settings_are_rejected():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(-1.0)
