"""Medusa heads: initialisation, sequential independence, typical acceptance, and the training loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from amphista_jax.drafters import Medusa
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import Output, Transformer, init_params
from amphista_jax.models.target import Target
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.tree import TreeSpec, batched, tree_arrays
from amphista_jax.trees.verify import AcceptanceConfig, verify_typical

CONFIG = tiny_llama_config()


def test_fresh_heads_equal_the_target_lm_head():
    params = init_params(CONFIG, jax.random.key(0))
    medusa = Medusa(num_heads=3, num_layers=2)
    heads = medusa.init(jax.random.key(1), Target(CONFIG, params))
    hidden = jax.random.normal(jax.random.key(2), (4, CONFIG.hidden_size))
    logits = medusa.head_logits(heads, Target(CONFIG, params), hidden)  # zero ResBlocks: x + silu(0) = x
    target = Transformer(CONFIG).apply({"params": params}, hidden, method=Transformer.logits)
    for k in range(3):
        np.testing.assert_allclose(np.asarray(logits[:, k]), np.asarray(target), atol=1e-5)


def test_typical_acceptance_literal():
    """Root's distribution puts 0.6 on token 1: child token 1 is typical, token 3 (p=0.02) is not."""
    vocab = 4
    tree = batched(tree_arrays(TreeSpec(((0,), (1,)))), 1)
    root = jnp.log(jnp.array([0.3, 0.6, 0.08, 0.02]))
    logits = jnp.stack([root, root, root])[None]  # [1, 3, V]
    cfg = AcceptanceConfig("typical", posterior_threshold=0.09, posterior_alpha=0.3)
    good = verify_typical(jnp.array([[0, 1, 3]]), logits, tree, SamplingConfig(1.0), cfg, jax.random.key(0))
    assert good.n_accepted.tolist() == [2] and good.accepted_nodes.tolist() == [[0, 1]]
    bad = verify_typical(jnp.array([[0, 3, 3]]), logits, tree, SamplingConfig(1.0), cfg, jax.random.key(0))
    assert bad.n_accepted.tolist() == [1] and bad.accepted_nodes.tolist() == [[0, -1]]
    assert logits.shape[-1] == vocab


def test_head_k_at_position_t_is_trained_on_token_t_plus_2_plus_k():
    """Only label position j is a target: head k's loss must depend on the hidden state at j - 2 - k alone."""
    params = init_params(CONFIG, jax.random.key(0))
    medusa = Medusa(num_heads=3, loss_decay=1.0)
    heads = medusa.init(jax.random.key(1), Target(CONFIG, params))
    tokens = jax.random.randint(jax.random.key(3), (1, 12), 0, CONFIG.vocab_size)
    j = 9
    batch = {"tokens": tokens, "loss_mask": jnp.zeros_like(tokens).at[0, j].set(1)}
    hidden = jax.random.normal(jax.random.key(4), (1, 12, CONFIG.hidden_size))
    for k in range(3):
        def head_loss(h, k=k):
            return medusa.loss(heads, Target(CONFIG, params), batch, Output(h, None, None))[1][f"head{k}/loss"]

        grad = jnp.abs(jax.grad(head_loss)(hidden)).sum(-1)[0]  # [T]
        assert np.flatnonzero(np.asarray(grad)).tolist() == [j - 2 - k]


def test_loss_trains_heads_toward_shifted_labels():
    params = init_params(CONFIG, jax.random.key(0))
    medusa = Medusa(num_heads=2)
    heads = medusa.init(jax.random.key(1), Target(CONFIG, params))
    tokens = jax.random.randint(jax.random.key(3), (4, 24), 0, CONFIG.vocab_size)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}
    target_out = Transformer(CONFIG).apply({"params": params}, tokens, jnp.broadcast_to(jnp.arange(24), (4, 24)))
    opt = optax.adam(3e-3)
    state = opt.init(heads)

    @jax.jit
    def step(h, s):
        (loss, metrics), grads = jax.value_and_grad(lambda p: medusa.loss(p, Target(CONFIG, params), batch, target_out),
                                                    has_aux=True)(h)
        updates, s = opt.update(grads, s)
        return optax.apply_updates(h, updates), s, loss, metrics

    first = None
    for _ in range(60):
        heads, state, loss, metrics = step(heads, state)
        first = float(loss) if first is None else first
    assert float(loss) < 0.5 * first
    assert float(metrics["head0/top5"]) >= float(metrics["head0/top1"]) > 0.5


def test_head_metrics_match_top_k_definition():
    """Top-1/top-5 by rank counting == membership in `lax.top_k` (masked positions ignored)."""
    from amphista_jax.drafters.losses import head_metrics

    logits = jax.random.normal(jax.random.key(0), (3, 40, 50))
    labels = jax.random.randint(jax.random.key(1), (3, 40), 0, 50)
    labels = labels.at[:, ::3].set(jnp.argmax(logits, -1)[:, ::3])  # make some top-1 hits certain
    mask = (jax.random.uniform(jax.random.key(2), (3, 40)) < 0.7).astype(jnp.float32)
    _, metrics = head_metrics(logits, labels, mask)
    top5 = np.asarray(jax.lax.top_k(logits, 5)[1])
    m, lab = np.asarray(mask), np.asarray(labels)
    np.testing.assert_allclose(float(metrics["top1"]), ((top5[..., 0] == lab) * m).sum() / m.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["top5"]), ((top5 == lab[..., None]).any(-1) * m).sum() / m.sum(),
                               rtol=1e-6)
    np.testing.assert_allclose(float(metrics["loss"]), float(
        (optax.softmax_cross_entropy_with_integer_labels(logits, labels) * mask).sum() / mask.sum()), rtol=1e-6)


def test_a_shallow_tree_computes_only_its_heads():
    """`heads=k` gives exactly the first k heads' logits (the vocabulary projections of the others are skipped)."""
    params = init_params(CONFIG, jax.random.key(0))
    medusa = Medusa(num_heads=4)
    heads = medusa.init(jax.random.key(1), Target(CONFIG, params))
    heads["w"] = jax.random.normal(jax.random.key(3), heads["w"].shape) * 0.2  # distinct heads
    hidden = jax.random.normal(jax.random.key(2), (3, CONFIG.hidden_size))
    target = Target(CONFIG, params)
    full = medusa.head_logits(heads, target, hidden)
    np.testing.assert_array_equal(np.asarray(medusa.head_logits(heads, target, hidden, heads=2)),
                                  np.asarray(full[:, :2]))
