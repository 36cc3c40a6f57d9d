"""DFlash: the reference's feature layers, a released checkpoint read and checked against an independent numpy
forward of the reference architecture, the decode-time block equal to the training block, the training loss equal
to a direct computation, greedy losslessness on chains and trees at batch 1 and 3, typical acceptance, one compile,
and one-line bad settings. (Sampling's losslessness: `test_speculative.py`'s chi-square, case `dflash-iid-q`.)"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from amphista_jax.drafters import DFlash
from amphista_jax.drafters.dflash import reference_layer_ids
from amphista_jax.drafters.published import PublishedHeadsError, read_dflash
from amphista_jax.engine.decode import pad_prompts, speculative_generate
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import Transformer, init_params
from amphista_jax.models.target import Target
from amphista_jax.train.step import target_forward
from amphista_jax.trees.names import get_tree
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.tree import TreeError, chain
from amphista_jax.trees.verify import AcceptanceConfig
from tests.helpers import (
    CONFIG,
    PROMPTS,
    assert_compiles_once,
    assert_greedy_lossless,
    assert_trains,
    fitted_heads,
)

DEEP = tiny_llama_config(num_layers=6, vocab_size=64)
LAYER_IDS = [1, 3]  # fused outputs of target layers 1 and 3
BLOCK = 4
MASK_ID = 63


@pytest.fixture(scope="module")
def target():
    return Target(CONFIG, init_params(CONFIG, jax.random.key(0)))


@pytest.fixture(scope="module")
def deep():
    params = jax.tree.map(lambda x: x * 4 if x.ndim >= 2 else x, init_params(DEEP, jax.random.key(1)))
    return Target(DEEP, params)


def test_reference_feature_layers():
    """The reference's `round(1 + i (L - 4) / (n - 1))` (Qwen3-8B's released 1, 9, 17, 25, 33), read as the
    inputs of the next layers."""
    assert reference_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert reference_layer_ids(30, 5) == (1, 8, 14, 20, 27)  # SmolLM2: 7.5 -> 8 and 20.5 -> 20 (Python's round)
    assert reference_layer_ids(40, 1) == (20,)
    assert DFlash().captured_layers(tiny_llama_config(num_layers=30)) == (2, 9, 15, 21, 28)
    assert DFlash(target_layer_ids=(1, 3)).captured_layers(DEEP) == (2, 4)


def test_bad_settings_are_one_line(target):
    with pytest.raises(ValueError, match="block_size=1 must be an integer >= 2"):
        DFlash(block_size=1)
    with pytest.raises(ValueError, match="num_anchors=0"):
        DFlash(num_anchors=0)
    with pytest.raises(ValueError, match=r"target_layer_ids=\[1, 5\] must be layers 0 .. 4 of the target's 6"):
        DFlash(target_layer_ids=(1, 5)).captured_layers(DEEP)
    with pytest.raises(ValueError, match="block_size='16' must be an integer"):
        DFlash.from_settings({"block_size": "16"})
    with pytest.raises(TreeError, match="tree depth 4 needs 4 heads but these dflash heads draft 3 tokens deep"):
        DFlash(block_size=4).check_tree(chain(4), CONFIG.vocab_size)


# ---------------------------------------------------------------------------------------------------------------
# The reference architecture, written independently in numpy over the released layout's tensor names.

def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """HF's rotate-half RoPE of `x [T, H, Dh]` at `positions [T]`."""
    dh = x.shape[-1]
    freqs = positions[:, None] / theta ** (np.arange(0, dh, 2) / dh)  # [T, Dh/2]
    cos, sin = np.cos(np.concatenate([freqs, freqs], -1))[:, None], np.sin(np.concatenate([freqs, freqs], -1))[:, None]
    half = np.concatenate([-x[..., dh // 2:], x[..., : dh // 2]], -1)
    return x * cos + half * sin


def reference_block_logits(w: dict, cfg: dict, embed: np.ndarray, lm_head: np.ndarray, features: np.ndarray,
                           root: int) -> np.ndarray:
    """The reference's draft forward for one sequence: context `features [S, C D]` (positions 0 .. S - 1), the
    block `[root, MASK x (B - 1)]` at S .. S + B - 1, no mask -> logits `[B - 1, V]` of slots 1 .. B - 1."""
    eps, theta, dh = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["head_dim"]
    h, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    s, b = features.shape[0], cfg["block_size"]
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed[[root] + [cfg["dflash_config"]["mask_token_id"]] * (b - 1)]
    pos_ctx, pos_blk = np.arange(s), np.arange(s, s + b)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        hn = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rope(_rms((hn @ w[p + "self_attn.q_proj.weight"].T).reshape(b, h, dh), w[p + "self_attn.q_norm.weight"],
                       eps), pos_blk, theta)
        kin, positions = np.concatenate([ctx, hn]), np.concatenate([pos_ctx, pos_blk])
        k = _rope(_rms((kin @ w[p + "self_attn.k_proj.weight"].T).reshape(-1, kvh, dh),
                       w[p + "self_attn.k_norm.weight"], eps), positions, theta)
        v = (kin @ w[p + "self_attn.v_proj.weight"].T).reshape(-1, kvh, dh)
        k, v = np.repeat(k, h // kvh, axis=1), np.repeat(v, h // kvh, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(b, h * dh)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        m = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps)[1:] @ lm_head


@pytest.fixture(scope="module")
def released(tmp_path_factory, deep):
    """A DFlash drafter for DEEP in the released layout (random weights), and its raw tensors and config."""
    c, rng = DEEP, np.random.default_rng(0)
    d, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"fc.weight": (d, len(LAYER_IDS) * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(2):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                   p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,),
                   p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "mlp.gate_proj.weight": (c.intermediate_size, d),
                   p + "mlp.up_proj.weight": (c.intermediate_size, d),
                   p + "mlp.down_proj.weight": (d, c.intermediate_size)}
    weights = {k: (1 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.2 * rng.standard_normal(s)
                   ).astype(np.float32) for k, s in shapes.items()}
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": BLOCK, "num_hidden_layers": 2,
           "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS}, "num_target_layers": 6,
           "hidden_size": d, "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope_theta, "vocab_size": c.vocab_size}
    src = tmp_path_factory.mktemp("dflash")
    save_file(weights, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps(cfg))
    drafter, params = read_dflash(src, deep)
    return src, weights, cfg, drafter, params


def _features(deep: Target, drafter: DFlash, tokens: jax.Array) -> np.ndarray:
    out = target_forward(Transformer(DEEP), deep.params, {"tokens": tokens}, drafter.captured_layers(DEEP))
    return np.asarray(out.captured)


def test_released_checkpoint_logits_equal_the_reference_forward(released, deep):
    """`convert --heads-from dflash`'s reader: the drafter's settings from config.json, and its block logits after
    a committed context equal the independent reference forward's (same tensors, the target's embedding of
    mask_token_id as MASK and its lm_head)."""
    _, weights, cfg, drafter, params = released
    assert drafter == DFlash(block_size=BLOCK, num_layers=2, target_layer_ids=(1, 3), mask_token_id=MASK_ID)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, DEEP.vocab_size)
    features = _features(deep, drafter, tokens)
    embed, lm_head = np.asarray(deep.embed(jnp.arange(DEEP.vocab_size))), np.asarray(deep.lm_head())
    cache = drafter.init_state(DEEP, 2, 32)
    lengths = jnp.asarray([9, 5])
    cache = drafter._commit(params, deep, jnp.asarray(features), lengths, cache)  # padded slots past each length
    ours = drafter.block_logits(params, deep, tokens[jnp.arange(2), lengths], cache, BLOCK - 1)
    for row, n in enumerate([9, 5]):
        ref = reference_block_logits(weights, cfg, embed, lm_head, features[row, :n], int(tokens[row, n]))
        np.testing.assert_allclose(np.asarray(ours[row]), ref, rtol=2e-4, atol=2e-4)


def test_a_checkpoint_for_another_target_is_one_line(released, tmp_path):
    src, weights, cfg, _, _ = released
    other = Target(tiny_llama_config(num_layers=3, vocab_size=64), init_params(tiny_llama_config(num_layers=3,
                                                                                                vocab_size=64),
                                                                            jax.random.key(0)))
    with pytest.raises(PublishedHeadsError, match=r"target_layer_ids=\[1, 3\] must be layers 0 .. 1"):
        read_dflash(src, other)
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 7}))
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(PublishedHeadsError, match="intermediate_size 7 but the target's layers have 128"):
        read_dflash(tmp_path, Target(DEEP, init_params(DEEP, jax.random.key(0))))


def test_the_decode_block_is_the_training_block(released, deep):
    """The block decoding drafts after `p` committed tokens (context written by `_commit`) is the training block at
    anchor `p` (context strictly before it under the training mask, several blocks in one forward)."""
    _, _, _, drafter, params = released
    tokens = jax.random.randint(jax.random.key(3), (2, 16), 0, DEEP.vocab_size)
    features = jnp.asarray(_features(deep, drafter, tokens))
    anchors = jnp.asarray([[3, 7, 11], [2, 5, 12]])
    cut = dataclasses.replace(drafter, draft_vocab=tuple(range(0, DEEP.vocab_size, 3)))  # decode_params cuts lm_head
    for d in (drafter, cut):
        train = d.draft_logits(params, deep, tokens, features, anchors, jnp.ones((2, 3), bool))  # [B, A, Bk-1, V]
        decoding = d.decode_params(params, deep)
        assert ("lm_head" in decoding) == bool(d.draft_vocab)
        for a in range(3):
            p = anchors[:, a]
            cache = d._commit(decoding, deep, features, p, d.init_state(DEEP, 2, 32))
            decode = d.block_logits(decoding, deep, tokens[jnp.arange(2), p], cache, BLOCK - 1)
            np.testing.assert_allclose(np.asarray(decode), np.asarray(train[:, a]), rtol=2e-4, atol=2e-4)


def test_loss_equals_a_direct_computation(released, deep):
    """The position-decayed block loss over the sampled anchors, computed directly: the reference forward of each
    anchor's block, CE against the data's token at anchor + k, each slot's mean weighted exp(-(k - 1) / gamma)."""
    _, weights, cfg, drafter, params = released
    drafter = DFlash(**{**drafter.__dict__, "num_anchors": 3, "loss_gamma": 2.0})
    tokens = jax.random.randint(jax.random.key(4), (2, 14), 0, DEEP.vocab_size)
    mask = np.zeros((2, 14), np.int32)
    mask[0, 4:], mask[1, 6:11] = 1, 1  # row 1: anchors 6 .. 9, blocks running past its last trained token
    batch = {"tokens": tokens, "loss_mask": jnp.asarray(mask), "rng": jax.random.key(5)}
    features = _features(deep, drafter, tokens)
    loss, metrics = drafter.loss(params, deep, batch, Transformer(DEEP).apply({"params": deep.params}, tokens,
                                                                               jnp.arange(14)[None].repeat(2, 0),
                                                                               captures=drafter.captured_layers(DEEP)))
    anchors, real = (np.asarray(x) for x in drafter.anchors(batch))
    assert real.all() and all(mask[r, p] and mask[r, p + 1] for r in range(2) for p in anchors[r])
    assert all(len(set(row)) == 3 and list(row) == sorted(row) for row in anchors)
    embed, lm_head = np.asarray(deep.embed(jnp.arange(DEEP.vocab_size))), np.asarray(deep.lm_head())
    per_slot: dict[int, list[float]] = {k: [] for k in range(1, BLOCK)}
    for r in range(2):
        for p in anchors[r]:
            logits = reference_block_logits(weights, cfg, embed, lm_head, features[r, :p], int(tokens[r, p]))
            for k in range(1, BLOCK):
                if p + k < 14 and mask[r, p + k]:
                    z = logits[k - 1] - logits[k - 1].max()
                    per_slot[k].append(float(np.log(np.exp(z).sum()) - z[int(tokens[r, p + k])]))
    w = {k: np.exp(-(k - 1) / 2.0) for k in per_slot}
    direct = sum(w[k] * np.mean(v) for k, v in per_slot.items()) / sum(w.values())
    np.testing.assert_allclose(float(loss), direct, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["head0/loss"]), np.mean(per_slot[1]), rtol=1e-4)


@pytest.fixture(scope="module")
def trained(target):
    return fitted_heads(DFlash(block_size=5, num_layers=2, num_anchors=8), target, steps=200, lr=3e-3,
                        metric="head0/top1", threshold=0.8)


@pytest.mark.parametrize("tree", ["chain-4", "small-8"])
def test_greedy_lossless(target, trained, tree):
    """Fitted DFlash drafts a chain and a per-depth top-k tree: batch 3 (ragged) and 1 equal AR, with more than
    1.5 tokens per target forward."""
    assert_greedy_lossless(target, DFlash(block_size=5, num_layers=2, num_anchors=8), trained, get_tree(tree),
                           trained=True)


def test_typical_acceptance_takes_fitted_drafts(target, trained):
    """Typical acceptance (Medusa's, not lossless) over DFlash's per-depth top-k tree at T=0.7, ragged batch 3:
    the fitted drafts are taken (the batch's 39 tokens after the first in under 26 target forwards), every row
    gets its tokens, and no step commits more than the tree's depth plus the root."""
    tree = get_tree("small-8")
    tokens, lengths = pad_prompts(PROMPTS)
    out = speculative_generate(target.params, trained, tokens, lengths, jax.random.key(2), config=CONFIG,
                               drafter=DFlash(block_size=5, num_layers=2, num_anchors=8), tree=tree,
                               max_new_tokens=40, cache_size=128, sampling=SamplingConfig(0.7),
                               acceptance=AcceptanceConfig("typical"))
    np.testing.assert_array_equal(np.asarray(out.num_tokens), 40)
    assert (np.asarray(out.accept_lengths) <= tree.depth + 1).all()
    assert 39 / int(out.steps) > 1.5


def test_compiles_once_and_trains(target):
    drafter = DFlash(block_size=4, num_layers=1, num_anchors=4)
    assert_compiles_once(target.params, drafter, drafter.init(jax.random.key(1), target), get_tree("small-8"))
    assert_trains(drafter, target)
