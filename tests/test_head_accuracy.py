"""Per-head held-out accuracy: the shared function agrees with a hand computation on the real held-out split."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.assets import default_model_dir
from amphista_jax.drafters import DRAFTERS, Medusa
from amphista_jax.evals.head_accuracy import head_accuracy, heldout_batches
from amphista_jax.models.hf import load_params
from amphista_jax.models.llama import Transformer
from amphista_jax.models.target import Target
from amphista_jax.models.tokenizer import load_tokenizer
from amphista_jax.train.config import DataConfig
from tests.helpers import default_cases


def test_untrained_medusa_heads_equal_the_targets_own_head_shifted():
    """Untrained Medusa heads are the target's lm_head on its last hidden state, so head k's top-1 accuracy is
    how often the target's argmax at t equals the held-out token at t + 2 + k: computed here by hand."""
    model_dir = default_model_dir()
    params, config = load_params(model_dir, dtype="float32")
    batches = heldout_batches(load_tokenizer(model_dir), DataConfig(kind="stdlib", max_len=64, batch_size=4), 2)
    assert len(batches) == 2 and batches[0]["tokens"].shape == (4, 64)
    drafter = Medusa(num_heads=3)
    target = Target(config, params)
    acc = head_accuracy(target, drafter, drafter.init(jax.random.key(0), target), batches)
    assert sorted(acc) == [0, 1, 2]
    model = Transformer(config)
    for k in range(3):
        per_batch = []
        for b in batches:
            tokens = jnp.asarray(b["tokens"])
            positions = jnp.broadcast_to(jnp.arange(64), tokens.shape)
            logits = np.asarray(model.apply({"params": params}, tokens, positions).logits)
            pred = logits.argmax(-1)[:, : 64 - k - 2]
            per_batch.append((pred == np.asarray(tokens)[:, k + 2:]).mean())
        np.testing.assert_allclose(acc[k]["top1"], np.mean(per_batch), atol=1e-6)
        assert acc[k]["top1"] <= acc[k]["top5"] <= 1.0
    assert acc[0]["top1"] > acc[2]["top1"]  # predicting further ahead is harder


# Every registered drafter under `-m slow`; by default Medusa's parallel heads and EAGLE's and Gumiho's
# feature-level stacks.
FAST_HEAD_ACCURACY = {"medusa", "eagle", "gumiho"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST_HEAD_ACCURACY else (pytest.mark.slow,))
                                  for n in sorted(DRAFTERS) if DRAFTERS[n].trainable])
@default_cases('medusa', 'eagle')
def test_every_registered_drafter_reports_per_head_accuracy(name: str):
    model_dir = default_model_dir()
    params, config = load_params(model_dir, dtype="float32")
    batches = heldout_batches(load_tokenizer(model_dir), DataConfig(kind="stdlib", max_len=32, batch_size=2), 1)
    target = Target(config, params)
    drafter = DRAFTERS[name]()
    acc = head_accuracy(target, drafter, drafter.init(jax.random.key(0), target), batches)
    assert len(acc) >= 1
    assert all(0.0 <= v["top1"] <= v["top5"] <= 1.0 for v in acc.values())
