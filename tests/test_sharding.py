"""Sharded loading onto a (data=2, fsdp=2, tensor=2) mesh of 8 emulated CPU devices."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from amphista_jax.drafters import VARIANTS
from amphista_jax.drafters.draft_model import DraftModel
from amphista_jax.engine.decode import generate, pad_prompts, spec_init, speculative_generate
from amphista_jax.engine.decode_spec import DecodeSpec, scratch_slots
from amphista_jax.engine.sharding import (
    LOGICAL_RULES,
    batch_sharding,
    cache_sharding,
    make_mesh,
    on_mesh,
    param_shardings,
    place_for_decoding,
)
from amphista_jax.infra.errors import UserError
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.hf import load_params, save_params
from amphista_jax.models.llama import Transformer, init_params, new_cache
from amphista_jax.models.param_layout import split_layers
from amphista_jax.models.target import Target
from amphista_jax.trees.growth import dynamic_tree
from amphista_jax.trees.names import get_tree
from tests.helpers import default_cases

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


def test_place_for_decoding_keeps_the_layout_and_places_once():
    """Either layout lands by its logical axes; arrays placed already are not copied (one target, many drafters);
    sizes that do not fit the devices are a `UserError` naming the fix."""
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    stacked = jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(0))
    for params, q, spec in ((stacked, ("layers", "kernel"), ("fsdp", "tensor")),
                            (split_layers(stacked), ("layer_0", "weight"), ("tensor", "fsdp"))):  # out-major
        placed, none = place_for_decoding(mesh, CONFIG, params)
        kernel = placed[q[0]]["attn"]["q_proj"][q[1]]
        assert none is None and tuple(kernel.sharding.spec)[-2:] == spec
        again, _ = place_for_decoding(mesh, CONFIG, placed)
        assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(placed), strict=True))
    with pytest.raises(UserError, match="12 devices, but 8 are available"):
        make_mesh(data=3, fsdp=2, tensor=2)


PROMPTS4 = [[5, 9, 33, 8, 1, 77, 4, 3, 100], [11, 12], [200, 1, 2, 3, 4], [7, 7, 8]]
# Trees each drafter fills (Gumiho and EAGLE-2 grow their own inside a budget).
SPEC_TREES = {"eagle": dynamic_tree(12, 3, 4), "gumiho": dynamic_tree(24, 5, 10)}
SHARDED_METHODS = [pytest.param(m, marks=() if m in ("medusa", "amphista", "eagle") else pytest.mark.slow)
                   for m in VARIANTS if VARIANTS[m].trainable]  # prompt lookup (no params): test_prompt_lookup


@pytest.mark.parametrize("method", SHARDED_METHODS)
# Amphista's extra caches are placed by the same rules as EAGLE's; its case runs under -m slow.
@default_cases('eagle', 'medusa')
def test_sharded_speculative_generate_equals_one_device(method):
    """Greedy, batch 4: the target (decoding's layout) and the drafter sharded over (data=2, fsdp=2, tensor=2),
    caches on batch and KV heads, give one device's tokens; AR too."""
    params = split_layers(init_params(CONFIG, jax.random.key(0)))
    drafter = VARIANTS[method]
    draft = drafter.init(jax.random.key(1), Target(CONFIG, params))
    tree = SPEC_TREES.get(method, get_tree("chain-3" if method.startswith("sar") else "small-8"))
    tokens, lengths, kw, one, mesh, sharded_params, sharded_draft = _one_device_and_placed(params, drafter, draft, tree)
    assert not sharded_params["layer_0"]["attn"]["q_proj"]["weight"].sharding.is_fully_replicated
    assert not max(jax.tree.leaves(sharded_draft), key=lambda x: x.size).sharding.is_fully_replicated
    with on_mesh(mesh):
        out = speculative_generate(sharded_params, sharded_draft, tokens, lengths, jax.random.key(0), **kw)
        state = jax.jit(spec_init, static_argnames=("cache_size", "spec"))(
            sharded_params, sharded_draft, tokens, lengths, jax.random.key(0), cache_size=kw["cache_size"],
            spec=DecodeSpec(CONFIG, drafter, tree, 12))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
    np.testing.assert_array_equal(np.asarray(out.num_tokens), np.asarray(one.num_tokens))
    kv = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None, "tensor"))  # rows, KV heads
    assert state.cache.k.sharding.is_equivalent_to(kv, 5)
    if method == "medusa":
        ar = dict(config=CONFIG, max_new_tokens=12, cache_size=tokens.shape[1] + 12)
        with on_mesh(mesh):
            sharded_ar = generate(sharded_params, tokens, lengths, jax.random.key(0), **ar)
        np.testing.assert_array_equal(np.asarray(sharded_ar.tokens),
                                      np.asarray(generate(params, tokens, lengths, jax.random.key(0), **ar).tokens))


def test_int8_draft_model_on_a_mesh_is_sharded_like_its_projections_and_decodes_as_one_device():
    """A draft model keeping int8 projections (`weights="int8"`, kept as at load) placed over (data=2, fsdp=2,
    tensor=2): each int8 weight sharded as the projection it quantizes, its row scales as its rows; greedy, batch 4,
    the tokens of one device, which are AR's."""
    params = split_layers(init_params(CONFIG, jax.random.key(0)))
    drafter = DraftModel(layers=1, weights="int8")
    kept = drafter.kept_params(drafter.init(jax.random.key(1), Target(CONFIG, params)))
    tree = get_tree("chain-3")
    tokens, lengths, kw, one, mesh, sharded_params, sharded_draft = _one_device_and_placed(params, drafter, kept, tree)
    projections = [p for p in _dicts(sharded_draft) if "weight_scale" in p]
    assert projections and all(p["weight"].dtype == jnp.int8 for p in projections)
    assert not all(p["weight"].sharding.is_fully_replicated for p in projections)
    for p in projections:
        rows = p["weight"].sharding.spec[0] if p["weight"].sharding.spec else None
        assert p["weight_scale"].sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(rows)), 1)
    with on_mesh(mesh):
        out = speculative_generate(sharded_params, sharded_draft, tokens, lengths, jax.random.key(0), **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
    ar = generate(params, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=12,
                  cache_size=tokens.shape[1] + 12)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))


def _one_device_and_placed(params: dict, drafter, draft, tree) -> tuple:
    """Greedy speculative decoding of `PROMPTS4` (12 new tokens) on one device, and the params placed over (data=2,
    fsdp=2, tensor=2): (tokens, lengths, the decode keywords, one device's output, mesh, target params, draft params
    placed)."""
    tokens, lengths = pad_prompts(PROMPTS4)
    kw = dict(config=CONFIG, drafter=drafter, tree=tree, max_new_tokens=12,
              cache_size=tokens.shape[1] + 12 + scratch_slots(drafter, tree))
    one = speculative_generate(params, draft, tokens, lengths, jax.random.key(0), **kw)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    return (tokens, lengths, kw, one, mesh, *place_for_decoding(mesh, CONFIG, params, drafter, draft))


def _dicts(tree: dict) -> list[dict]:
    """Every dict in a nested dict of params, itself first."""
    return [tree, *(d for v in tree.values() if isinstance(v, dict) for d in _dicts(v))]
