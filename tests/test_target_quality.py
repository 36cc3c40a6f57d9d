"""Target-quality measures: bits per byte is exact on a model of known loss; the loop detector."""

from __future__ import annotations

import math

import jax
import pytest

from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Transformer, init_params
from amphista_jax.prompts import ends_in_loop
from amphista_jax.train.corpus import train_tokenizer
from amphista_jax.train.pretrain_target import bits_per_byte

TEXTS = ["def add(a, b):\n    return a + b\n", "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
         "import os\nprint(os.getcwd())\n" * 3]


def test_bits_per_byte_of_a_uniform_model_is_log2_vocab_per_byte():
    tok = train_tokenizer(TEXTS * 4, vocab_size=300)
    config = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8)
    params = init_params(config, jax.random.key(0))
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 0  # uniform next-token distribution
    ids = tok(TEXTS)["input_ids"]
    # Every token but the BOS frames is a target (the text's tokens and its EOS); several windows and a padded tail.
    targets = sum(len(x) - 1 + 1 for x in ids)
    expected = targets * math.log2(len(tok)) / sum(len(t.encode()) for t in TEXTS)
    got = bits_per_byte(Transformer(config), params, tok, TEXTS, seq_len=8, batch_size=3)
    assert got == pytest.approx(expected, rel=1e-5)


def test_bits_per_byte_equals_a_direct_forward_over_the_framed_texts():
    """A random (non-uniform) model, one window: the summed CE of every token after its BOS, EOS included."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    tok = train_tokenizer(TEXTS * 4, vocab_size=300)
    config = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8)
    params = init_params(config, jax.random.key(1))
    stream = np.concatenate([ids + [tok.eos_token_id] for ids in tok(TEXTS)["input_ids"]])
    logits = Transformer(config).apply({"params": params}, jnp.asarray(stream[None, :-1]),
                                       jnp.arange(len(stream) - 1)[None]).logits[0]
    ce = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(stream[1:])))
    expected = ce[stream[1:] != tok.bos_token_id].sum() / math.log(2) / sum(len(t.encode()) for t in TEXTS)
    got = bits_per_byte(Transformer(config), params, tok, TEXTS, seq_len=len(stream) + 5, batch_size=2)
    assert got == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("tokens, looping", [
    ([1, 2, 3] * 10, True),  # period 3 over the whole tail
    (list(range(40)) + [7] * 24, True),  # a stuck token
    (list(range(10)) + [5, 6, 7, 8, 9, 10, 11, 12] * 4, True),  # period 8 repeated 4 times = 32 >= 24
    (list(range(60)), False),
    ([1, 2, 3] * 10 + [4], False),  # broke out of the loop at the end
    ([1, 2] * 5, False),  # too short to call a loop
])
def test_ends_in_loop(tokens, looping):
    assert ends_in_loop(tokens) is looping
