"""Parity with `transformers` (PyTorch) on tiny random models of every supported variant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.engine.decode import generate, pad_prompts
from amphista_jax.models.hf import load_params
from amphista_jax.models.llama import Transformer

torch = pytest.importorskip("torch")


def test_logits_match_transformers(hf_model):
    model, path = hf_model
    params, config = load_params(path)
    tokens = np.random.RandomState(0).randint(0, config.vocab_size, (2, 16))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    ours = Transformer(config).apply({"params": params}, jnp.asarray(tokens), positions).logits
    np.testing.assert_array_less(np.abs(np.asarray(ours) - ref).max(), 1e-4)


def test_greedy_generation_matches_transformers(hf_model):
    model, path = hf_model
    params, config = load_params(path)
    prompts = [[3, 17, 29, 4, 88, 9, 12], [51, 7, 99]]
    tokens, lengths = pad_prompts(prompts)
    out = generate(params, tokens, lengths, jax.random.key(0), config=config, max_new_tokens=32, cache_size=64)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        np.testing.assert_array_equal(np.asarray(out.tokens[row]), ref.numpy()[0, len(prompt):])
        assert int(out.num_tokens[row]) == 32
