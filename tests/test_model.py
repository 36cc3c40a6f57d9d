"""KV-cache consistency and cache compaction on random tiny models (no torch needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.models.cache import compact
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import Transformer, init_params, new_cache
from amphista_jax.models.param_layout import split_layers
from pallas_kernels.dense_attention import apply_window, dot_product_attention, key_visibility
from tests.helpers import default_cases


def _positions(b: int, start: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(start, start + t), (b, t))


@pytest.mark.parametrize("windows", [(0, 0), (5, 0), (3, 3)])
@default_cases('windows1', 'windows2')
def test_prefill_then_steps_equals_full_forward(windows):
    """By default (5, 0) and (3, 3) run: (5, 0)'s second layer has no window, the path (0, 0) takes."""
    config = tiny_llama_config(sliding_windows=windows)
    params = init_params(config, jax.random.key(0))
    model = Transformer(config)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size)
    full = model.apply({"params": params}, tokens, _positions(2, 0, 12)).logits

    out = model.apply({"params": params}, tokens[:, :5], _positions(2, 0, 5), new_cache(config, 2, 16))
    cache, pieces = out.cache.advance(5), [out.logits]
    for i in range(5, 12):
        out = model.apply({"params": params}, tokens[:, i:i + 1], _positions(2, i, 1), cache)
        cache, pieces = out.cache.advance(1), pieces + [out.logits]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, 1)), np.asarray(full), atol=1e-5)
    assert cache.lengths.tolist() == [12, 12]


def test_key_visibility_literal():
    """One committed token, then a 3-node tree: root 0 with children 1 and 2 (siblings)."""
    tree = jnp.array([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], bool)
    positions = jnp.array([[1, 2, 2]])
    visible, distance = key_visibility(positions, tree, jnp.array([1]), num_keys=6)
    expected = np.array([
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
    ], bool)
    np.testing.assert_array_equal(np.asarray(visible[0]), expected)
    np.testing.assert_array_equal(np.asarray(distance[0, :, :2]), [[1, 0], [2, 1], [2, 1]])
    window_2 = apply_window(visible, distance, 2)[0]  # keys less than 2 positions back
    np.testing.assert_array_equal(np.asarray(window_2[1]), [0, 1, 1, 0, 0, 0])


@pytest.mark.parametrize("per_query", [0, 3])
def test_diagonal_keys_equal_a_mask_over_them(per_query: int):
    """Keys each query alone sees (`diagonal`, training-time test's path) give what the dense path gives with
    them laid out as `T * J` more keys under a mask that shows query t its own J; a query that sees no shared
    key still attends to its own."""
    b, t, s, hq, hkv, dh = 2, 5, 7, 4, 2, 8
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i, shape in
               enumerate([(b, t, hq, dh), (b, s, hkv, dh), (b, s, hkv, dh)]))
    dk, dv = (jax.random.normal(jax.random.key(3 + i), (b, t, per_query, hkv, dh)) for i in range(2))
    visible = jax.random.bernoulli(jax.random.key(5), 0.5, (b, t, s)).at[0, 1].set(False)
    own = jnp.broadcast_to(jnp.repeat(jnp.eye(t, dtype=bool), per_query, axis=1), (b, t, t * per_query))
    dense = dot_product_attention(q, jnp.concatenate([k, dk.reshape(b, t * per_query, hkv, dh)], 1),
                                  jnp.concatenate([v, dv.reshape(b, t * per_query, hkv, dh)], 1),
                                  jnp.concatenate([visible, own], -1))
    diagonal = dot_product_attention(q, k, v, visible, (dk, dv))
    np.testing.assert_allclose(np.asarray(diagonal), np.asarray(dense), atol=1e-5)
    if per_query == 0:  # the row that sees nothing gets zeros either way
        np.testing.assert_array_equal(np.asarray(diagonal[0, 1]), 0.0)


@pytest.mark.slow
def test_compact_moves_accepted_tree_path():
    """Verify a 3-node tree (root, two sibling children), accept root + second child: the cache then holds
    exactly what a plain forward over the accepted tokens produces. Under -m slow: test_speculative.py's
    test_partial_paths_through_later_siblings_stay_lossless[windows1-mc_sim_7b_63] commits paths through non-first
    siblings, which stay lossless only if compaction moves them right."""
    config = tiny_llama_config()
    params = init_params(config, jax.random.key(0))
    model = Transformer(config)
    prompt = jax.random.randint(jax.random.key(1), (2, 4), 0, config.vocab_size)
    cache = model.apply({"params": params}, prompt, _positions(2, 0, 4), new_cache(config, 2, 12)).cache.advance(4)
    tree_tokens = jnp.array([[10, 11, 12], [20, 21, 22]])
    tree_mask = jnp.broadcast_to(jnp.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), (2, 3, 3))
    tree_pos = jnp.array([[4, 5, 5]] * 2)
    tree = model.apply({"params": params}, tree_tokens, tree_pos, cache, tree_mask)
    # row 0 accepts nodes (0, 2); row 1 accepts only the root.
    compacted = compact(tree.cache, jnp.array([[0, 2], [0, -1]]), jnp.array([2, 1]))
    assert compacted.lengths.tolist() == [6, 5]

    probe = jnp.array([[7], [7]])
    got = model.apply({"params": params}, probe, compacted.lengths[:, None], compacted).logits
    seqs = [jnp.concatenate([prompt[0], jnp.array([10, 12, 7])]), jnp.concatenate([prompt[1], jnp.array([20, 7])])]
    for row, seq in enumerate(seqs):
        ref = model.apply({"params": params}, seq[None], _positions(1, 0, len(seq))).logits[0, -1]
        np.testing.assert_allclose(np.asarray(got[row, 0]), np.asarray(ref), atol=1e-5)


@pytest.mark.slow
def test_split_layers_is_the_same_model():
    """`split_layers` + `Transformer(split=True)` (one module per layer, no loop) computes what the stacked model
    computes: a prefill, then a cached step, with the same cache contents. Under -m slow: test_generate.py's
    test_per_layer_layout_generates_the_same_tokens covers the split layout generating the stacked model's tokens."""
    config = tiny_llama_config()
    params = init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(7), (2, 7))
    outs = []
    for model, p in ((Transformer(config), params), (Transformer(config, split=True), split_layers(params))):
        first = model.apply({"params": p}, tokens[:, :6], positions[:, :6], new_cache(config, 2, 8))
        step = model.apply({"params": p}, tokens[:, 6:], positions[:, 6:], first.cache.advance(6))
        outs.append((first.logits, step.logits, step.cache.k, step.cache.v))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
