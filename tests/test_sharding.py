"""Sharded loading onto a (data=2, fsdp=2, tensor=2) mesh of 8 emulated CPU devices."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.hf import load_params, save_params
from amphista_jax.models.llama import Transformer, init_params, new_cache
from amphista_jax.sharding import LOGICAL_RULES, batch_sharding, cache_sharding, make_mesh, param_shardings

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")

CONFIG = tiny_llama_config(num_heads=4, num_kv_heads=2, vocab_size=256)


def test_sharded_load_places_each_param_and_matches_unsharded(tmp_path):
    save_params(init_params(CONFIG, jax.random.key(0)), CONFIG, tmp_path, dtype="float32")
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shardings = param_shardings(CONFIG, mesh)
    params, _ = load_params(tmp_path, shardings=shardings)
    plain, _ = load_params(tmp_path)

    spec = lambda x: x.sharding.spec  # noqa: E731
    assert spec(params["embed"]["embedding"]) == PartitionSpec("tensor", "fsdp")
    assert spec(params["lm_head"]["kernel"]) == PartitionSpec("fsdp", "tensor")
    assert spec(params["layers"]["attn"]["q_proj"]["kernel"]) == PartitionSpec(None, "fsdp", "tensor")
    assert spec(params["layers"]["mlp"]["down_proj"]["kernel"]) == PartitionSpec(None, "tensor", "fsdp")
    assert spec(params["final_norm"]["scale"]) == PartitionSpec(None)
    q = params["layers"]["attn"]["q_proj"]["kernel"]
    assert {s.data.shape for s in q.addressable_shards} == {(2, 32, 32)}  # [L, D/fsdp, H*Dh/tensor]

    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 256, (4, 8)))
    positions = jnp.broadcast_to(jnp.arange(8), (4, 8))
    model = Transformer(CONFIG)
    cache = new_cache(CONFIG, 4, 16)

    def forward(p, t, pos, c):
        with nn.logical_axis_rules(LOGICAL_RULES):
            out = model.apply({"params": p}, t, pos, c)
        return out.logits, out.cache

    sharded = jax.jit(
        forward,
        in_shardings=(shardings, batch_sharding(mesh, tokens.shape), batch_sharding(mesh, positions.shape),
                      cache_sharding(mesh, cache)),
        out_shardings=(NamedSharding(mesh, PartitionSpec(("data", "fsdp"))), cache_sharding(mesh, cache)),
    )
    with jax.set_mesh(mesh):
        logits, out_cache = sharded(params, tokens, positions, cache)
    ref = model.apply({"params": plain}, tokens, positions).logits
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=1e-5)
    assert out_cache.k.sharding.spec == PartitionSpec(None, ("data", "fsdp"), None, "tensor", None)
