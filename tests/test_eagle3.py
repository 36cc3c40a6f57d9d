"""EAGLE-3: the target's captured low / middle / high features (at prefill, at verify, in either layer layout), the
training-time test (its step-j drafts are the drafts decoding makes from the same inputs), greedy losslessness on
static and dynamic trees, one compile, training, checkpoints and settings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amphista_jax.drafters import Eagle3
from amphista_jax.drafters.base import DraftContext, PrefillContext
from amphista_jax.drafters.eagle3 import reference_layers
from amphista_jax.drafters.feature_drafting import FeatureDrafting
from amphista_jax.drafters.io import load_draft, save_draft
from amphista_jax.engine.decode import prefill
from amphista_jax.models.cache import KVCache
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import Output, Transformer, init_params, new_cache
from amphista_jax.models.param_layout import split_layers
from amphista_jax.models.target import Target, forward
from amphista_jax.train.step import make_steps
from amphista_jax.trees.growth import dynamic_tree
from amphista_jax.trees.names import get_tree
from amphista_jax.trees.tree import batched, chain, tree_arrays
from tests.helpers import (
    CONFIG,
    assert_compiles_once,
    assert_greedy_lossless,
    assert_trains,
    default_cases,
    fitted_heads,
)

EAGLE3 = Eagle3()
DEEP = tiny_llama_config(num_layers=8)  # feature layers 2, 4, 5: three different ones


@pytest.fixture(scope="module")
def target():
    return Target(CONFIG, init_params(CONFIG, jax.random.key(0)))


@pytest.fixture(scope="module")
def heads(target):
    return EAGLE3.init(jax.random.key(1), target)


@pytest.fixture(scope="module")
def trained(target):
    """Heads fitted to the tiny target's own continuations (3 unrolled steps; fitted on first use)."""
    fitted = []

    def get() -> dict:
        if not fitted:
            fitted.append(fitted_heads(Eagle3(ttt_steps=3), target, steps=300, lr=3e-3, metric="head0/top1",
                                       threshold=0.85))
        return fitted[0]

    return get


def _positions(b: int, t: int, start: int = 0) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(start, start + t, dtype=jnp.int32), (b, t))


def test_captured_features_are_the_inputs_of_the_chosen_layers():
    """In both layer layouts, `captured` holds the residual stream before each chosen layer: normalised, it is
    the last hidden state of the target cut to that many layers (a plain forward, final norm scale 1)."""
    params = init_params(DEEP, jax.random.key(2))
    layers = reference_layers(DEEP.num_layers)
    assert layers == (2, 4, 5) == EAGLE3.captured_layers(DEEP)
    tokens = jax.random.randint(jax.random.key(3), (2, 20), 0, DEEP.vocab_size)
    stacked = Transformer(DEEP).apply({"params": params}, tokens, _positions(2, 20), captures=layers)
    split = Transformer(DEEP, split=True).apply({"params": split_layers(params)}, tokens, _positions(2, 20),
                                                captures=layers)
    assert stacked.captured.shape == (2, 20, 3 * DEEP.hidden_size)
    np.testing.assert_allclose(np.asarray(split.captured), np.asarray(stacked.captured), rtol=1e-5, atol=1e-5)
    for j, i in enumerate(layers):
        cut = jax.tree.map(lambda p, i=i: p[:i], params["layers"])
        cut_params = params | {"layers": cut, "final_norm": {"scale": jnp.ones(DEEP.hidden_size)}}
        cut_config = tiny_llama_config(num_layers=i)
        want = Transformer(cut_config).apply({"params": cut_params}, tokens, _positions(2, 20), return_logits=False)
        x = stacked.captured[..., j * DEEP.hidden_size: (j + 1) * DEEP.hidden_size]
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + DEEP.rms_norm_eps)
        np.testing.assert_allclose(np.asarray(normed), np.asarray(want.hidden), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_captured_features_at_verify_equal_a_plain_forward():
    """Prefill 12 tokens, then verify a chain of the next 5 under the tree mask: the verify forward's captured
    features are the plain forward's at those positions. Under -m slow: test_greedy_eagle3_equals_ar[trained-dynamic]'s
    heads, fitted on a plain forward's captures, must draft from the prefill's and verify's captures well enough to
    commit more than 1.5 tokens per target forward."""
    params = split_layers(init_params(DEEP, jax.random.key(2)))
    model, layers = Transformer(DEEP, split=True), reference_layers(DEEP.num_layers)
    tokens = jax.random.randint(jax.random.key(4), (2, 17), 0, DEEP.vocab_size)
    plain = model.apply({"params": params}, tokens, _positions(2, 17), captures=layers).captured
    out, cache, _, _ = prefill(model, params, tokens[:, :12], jnp.asarray([12, 12]), new_cache(DEEP, 2, 32), None,
                               layers)
    np.testing.assert_allclose(np.asarray(out.captured), np.asarray(plain[:, :12]), rtol=1e-4, atol=1e-4)
    tree = batched(tree_arrays(chain(4)), 2)
    verified = forward(model, params, tokens[:, 12:], cache.lengths[:, None] + tree.depth, cache, tree.mask, None,
                       captures=layers)
    np.testing.assert_allclose(np.asarray(verified.captured), np.asarray(plain[:, 12:]), rtol=1e-4, atol=1e-4)


def test_training_time_test_drafts_are_the_decode_drafts(target, heads):
    """The property EAGLE-3 trains for: at position t, step j of the unrolled training pass scores exactly what
    decoding scores at depth j + 1 of the path x_{t+2}, ..., x_{t+1+j} after committing x_{<= t+1} (prefill
    over the prompt, then the chain's nodes expanded one depth per call with their ancestors as scratch)."""
    drafter = Eagle3(ttt_steps=4)
    c = target.config
    tokens = jax.random.randint(jax.random.key(5), (1, 14), 0, c.vocab_size)
    out = Transformer(c).apply({"params": target.params}, tokens, _positions(1, 14),
                               captures=drafter.captured_layers(c))
    train = jax.nn.log_softmax(drafter.draft_logits(heads, target, tokens, out.captured), -1)  # [1, T, 4, V]
    t = 6
    prompt = jnp.where(jnp.arange(16)[None] <= t, jnp.pad(tokens, ((0, 0), (0, 2))), 0)
    ctx_out = Output(out.hidden, None, None, jnp.pad(out.captured, ((0, 0), (0, 2), (0, 0)), constant_values=7.0))
    lengths, root = jnp.asarray([t + 1]), tokens[:, t + 1]
    state = drafter.prefill(heads, target, PrefillContext(ctx_out, prompt, lengths, root),
                            drafter.init_state(c, 1, 32))
    drafting = FeatureDrafting(drafter, heads, target, DraftContext(out.hidden[:, t], root, lengths, state))
    np.testing.assert_allclose(np.asarray(drafting.logprobs(state["base"])), np.asarray(train[:, t, 0]), atol=2e-4)
    cache = state["caches"][0]
    slots = drafter.ttt_steps - 1
    scratch = tuple(jnp.zeros((1, 1, slots, c.num_kv_heads, c.head_dim)) for _ in range(2))
    feature = state["base"][:, None]
    for depth in range(1, drafter.ttt_steps):
        sees = (jnp.arange(slots) < depth - 1)[None, None]  # [1, 1, S]: the ancestors below the root
        feature, kv, _ = drafting.expand(tokens[:, t + 1 + depth][:, None], feature, depth, sees, scratch)
        scratch = tuple(s.at[:, :, depth - 1].set(x[:, :, 0]) for s, x in zip(scratch, kv, strict=True))
        np.testing.assert_allclose(np.asarray(drafting.logprobs(feature[:, 0])), np.asarray(train[:, t, depth]),
                                   atol=2e-4)
    assert isinstance(cache, KVCache) and int(cache.lengths[0]) == t + 1


def test_loss_weights_the_steps_and_a_step_moves_only_draft_params(target, heads):
    """The loss is the steps' teacher CEs weighted 0.8 ** j; a train step changes every draft param (the draft
    lm_head is the drafter's own copy) and leaves the target's params as they were."""
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, CONFIG.vocab_size)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}
    out = Transformer(CONFIG).apply({"params": target.params}, tokens, _positions(2, 16),
                                    captures=EAGLE3.captured_layers(CONFIG))
    loss, metrics = EAGLE3.loss(heads, target, batch, out)
    want = sum(0.8 ** j * float(metrics[f"head{j}/ttt"]) for j in range(EAGLE3.ttt_steps))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    drafter, optimizer = Eagle3(ttt_steps=2), optax.adam(1e-2)
    before_target = jax.tree.map(np.array, target.params)
    params = drafter.init(jax.random.key(1), target)
    before = jax.tree.map(np.array, params)
    step, _ = make_steps(Transformer(CONFIG), drafter, optimizer)
    state, _ = step({"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)},
                    target.params, jax.tree.map(np.asarray, batch))
    assert all(not np.array_equal(a, np.asarray(b))
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state["params"]), strict=True))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, np.asarray(b)), before_target, target.params)


def test_an_lm_term_in_place_of_the_teacher_learns_the_batchs_labels(target, heads):
    """With lm_weight 1 and teacher_weight 0 the loss is the steps' CEs against the labels (step j at t: token
    t + 2 + j), weighted 0.8 ** j, and does not read the target's logits."""
    tokens = jax.random.randint(jax.random.key(7), (2, 16), 0, CONFIG.vocab_size)
    labels = jax.random.randint(jax.random.key(8), (2, 16), 0, CONFIG.vocab_size)
    mask = jnp.ones_like(tokens).at[:, :5].set(0)
    out = Transformer(CONFIG).apply({"params": target.params}, tokens, _positions(2, 16),
                                    captures=EAGLE3.captured_layers(CONFIG))
    drafter = dataclasses.replace(EAGLE3, lm_weight=1.0, teacher_weight=0.0)
    assert drafter.reads_labels and not EAGLE3.reads_labels
    batch = {"tokens": tokens, "loss_mask": mask, "labels": labels}
    loss, _ = drafter.loss(heads, target, batch, out.replace(logits=None))
    logp = np.asarray(jax.nn.log_softmax(drafter.draft_logits(heads, target, tokens, out.captured), -1))
    want = 0.0
    for j in range(drafter.ttt_steps):
        shift, m = j + 2, np.asarray(mask)[:, j + 2:]
        nll = -np.take_along_axis(logp[:, : 16 - shift, j], np.asarray(labels)[:, shift:, None], -1)[..., 0]
        want += 0.8 ** j * (nll * m).sum() / m.sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


@pytest.mark.slow
def test_training_lowers_the_loss(target):
    """Under -m slow: test_greedy_eagle3_equals_ar[trained-dynamic]'s fitted heads (`fitted_heads` asserts head0/top1
    > 0.85 after training) cover that training lowers the loss."""
    assert_trains(EAGLE3, target)


@pytest.mark.parametrize(("weights", "tree"), [
    ("untrained", "dynamic-8x4x2"), ("untrained", "mc_sim_7b_63"), ("trained", "dynamic"),
    pytest.param("trained", "small-8", marks=pytest.mark.slow)])
# Trained on the dynamic tree by default; the static and untrained cases run under -m slow (see the docstring).
@default_cases('trained-dynamic')
def test_greedy_eagle3_equals_ar(target, heads, trained, weights, tree):
    """Under -m slow for the static trees: test_eagle.py's test_greedy_eagle_equals_ar[trained-mc_sim_7b_63] decodes
    the same `FeatureDrafting.static` losslessly, and [trained-dynamic] runs EAGLE-3's own node expansion and
    commits."""
    drafter = Eagle3(ttt_steps=3) if weights == "trained" else EAGLE3
    assert_greedy_lossless(target, drafter, trained() if weights == "trained" else heads, get_tree(tree),
                           weights == "trained")


def test_dynamic_tree_generation_compiles_once(target, heads):
    assert_compiles_once(target.params, EAGLE3, heads, dynamic_tree(12, 3, 4))


def test_checkpoint_round_trip(target, heads, tmp_path):
    drafter = Eagle3(feature_layers=(0, 1, 1), ttt_steps=5)
    save_draft(tmp_path / "heads", "eagle3", drafter, heads, CONFIG)
    method, loaded, restored = load_draft(tmp_path / "heads", CONFIG, target.params)
    assert (method, loaded) == ("eagle3", drafter)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), heads, restored)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="must name 3 target layers"):
        Eagle3(feature_layers=(1, 2))
    with pytest.raises(ValueError, match="ttt_steps"):
        Eagle3(ttt_steps=0)
    with pytest.raises(ValueError, match="step_decay"):
        Eagle3(step_decay=0.0)
    with pytest.raises(ValueError, match="not all 0"):
        Eagle3(teacher_weight=0.0)
    with pytest.raises(ValueError, match="layers of the target's 2"):
        Eagle3(feature_layers=(0, 1, 2)).captured_layers(CONFIG)
    assert reference_layers(32) == (2, 16, 29) and reference_layers(30) == (2, 15, 27)
