"""Hydra / Hydra++: drafts follow each node's own path (a node-by-node reference), siblings' subtrees differ
where Medusa's cannot, the prefix layer's cache matches the whole-sequence pass, the losses read the right
positions and train, checkpoints keep the variant, and decoding is lossless and compiles once."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.drafters import Hydra, Medusa
from amphista_jax.drafters.base import DraftContext
from amphista_jax.drafters.io import load_draft, save_draft
from amphista_jax.engine.decode import pad_prompts, speculative_generate
from amphista_jax.models.llama import Output, Transformer, init_params
from amphista_jax.models.target import Target
from amphista_jax.trees.names import PRESETS
from amphista_jax.trees.tree import TreeSpec, tree_arrays, tree_levels
from tests.helpers import (
    CONFIG,
    PROMPTS,
    assert_compiles_once,
    assert_greedy_lossless,
    assert_trains,
    default_cases,
    fitted_heads,
    replay_commits,
    sequence,
)

VARIANTS = {"hydra": Hydra(num_heads=4), "hydra++": Hydra.plus_plus(num_heads=4)}


@pytest.fixture(scope="module")
def target():
    return Target(CONFIG, init_params(CONFIG, jax.random.key(0)))


def _random_heads(hydra: Hydra, target: Target, seed: int = 1) -> dict:
    """Initialised params with random head layers (fresh heads read the base state alone), their first
    layers' path rows scaled up by the embeddings' small scale so the path weighs as much as the base state."""
    params = hydra.init(jax.random.key(seed), target)
    d = CONFIG.hidden_size
    embed_rms = float(jnp.sqrt(jnp.mean(target.params["embed"]["embedding"] ** 2)))

    def randomise(path, x):
        salt = zlib.crc32(jax.tree_util.keystr(path).encode())  # stable across processes, unlike hash()
        noise = 0.3 * jax.random.normal(jax.random.fold_in(jax.random.key(seed), salt % 2**31), x.shape) / np.sqrt(
            x.shape[0])
        if x.ndim == 2 and x.shape[0] > d:  # a first layer: rows past D read the path's embeddings
            noise = noise.at[d:].divide(embed_rms)
        return x + noise

    heads = {k: v for k, v in params.items() if k.startswith("head")}
    return params | jax.tree_util.tree_map_with_path(randomise, heads)


def _context(hydra: Hydra, batch: int, seed: int = 4) -> DraftContext:
    hidden = jax.random.normal(jax.random.key(seed), (batch, CONFIG.hidden_size))
    root = jax.random.randint(jax.random.key(seed + 1), (batch,), 0, CONFIG.vocab_size)
    state = {"prefix": jax.random.normal(jax.random.key(seed + 2), hidden.shape)} if hydra.prefix_layer else ()
    return DraftContext(hidden, root, jnp.zeros((batch,), jnp.int32), state)


def test_tree_levels_literal():
    """small-8: root -> (0,) (1,) (2,); (0,) -> (0,0) (0,1); (1,) -> (1,0); (0,0) -> (0,0,0)."""
    levels = tree_levels(PRESETS["small-8"])
    assert [lv.nodes.tolist() for lv in levels] == [[1, 2, 3], [4, 5, 6], [7]]
    assert [lv.parent_slot.tolist() for lv in levels] == [[0, 0, 0], [0, 0, 1], [0]]
    assert [lv.rank.tolist() for lv in levels] == [[0, 1, 2], [0, 1, 0], [0]]
    assert [lv.expand.tolist() for lv in levels] == [[0, 1], [0], []]


def test_fresh_heads_start_from_the_target_lm_head(target):
    hydra = Hydra(num_heads=3, num_layers=2)
    params = hydra.init(jax.random.key(0), target)
    base = jax.random.normal(jax.random.key(1), (5, CONFIG.hidden_size))
    want = Transformer(CONFIG).apply({"params": target.params}, base, method=Transformer.logits)
    for k in range(3):
        path = jax.random.randint(jax.random.key(2 + k), (5, k + 1), 0, CONFIG.vocab_size)
        np.testing.assert_allclose(np.asarray(hydra.head_logits(params, target, k, base, path)), np.asarray(want),
                                   atol=1e-4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("tree", sorted(PRESETS))
@default_cases('mc_sim_7b_63-hydra++', 'small-8-hydra')
def test_every_node_is_the_topk_of_its_own_path(target, variant, tree):
    """Node-by-node reference: node n's token is rank `rank[n]` of head `depth(n) - 1` applied to the
    tokens on n's own path (root .. parent). By default one branching tree per variant runs (Hydra++'s prefix
    state, plain Hydra's base state): chains and the other trees take the same level-by-level code path."""
    hydra = VARIANTS[variant]
    params = _random_heads(hydra, target)
    arrays = tree_arrays(PRESETS[tree])
    ctx = _context(hydra, batch=2)
    propose = jax.jit(lambda p, c: hydra.propose(p, target, c, PRESETS[tree], jax.random.key(0)))  # tree: static
    tokens = np.asarray(propose(params, ctx).tokens)
    assert (tokens[:, 0] == np.asarray(ctx.root)).all()
    base = hydra.base_state(ctx)[:, None]  # [B, 1, D]
    head_logits = jax.jit(hydra.head_logits, static_argnums=2)
    parent, depth, rank = (np.asarray(a) for a in (arrays.parent, arrays.depth, arrays.rank))
    for d in range(1, PRESETS[tree].depth + 1):
        nodes = np.flatnonzero(np.asarray(arrays.valid) & (depth == d))
        paths = np.zeros((len(nodes), d), np.int64)  # node ids root .. parent of every node of depth d
        for row, node in enumerate(nodes):
            for i in range(d - 1, -1, -1):
                node = parent[node]
                paths[row, i] = node
        logits = head_logits(params, target, d - 1, base, jnp.asarray(tokens[:, paths]))  # [B, C, V]
        top = np.asarray(jax.lax.top_k(logits, int(rank[nodes].max()) + 1)[1])
        np.testing.assert_array_equal(tokens[:, nodes], top[:, np.arange(len(nodes)), rank[nodes]])


@pytest.mark.slow
def test_changing_a_depth1_token_changes_the_depth2_drafts_under_it(target):
    """Hydra's head 2 reads the depth-1 token, so siblings' children differ; Medusa's heads do not, so the
    children under every depth-1 node are copies. Under -m slow:
    test_head_k_reads_the_true_path_tokens_t_plus_1_to_t_plus_1_plus_k (each head reads its path's tokens) and
    test_every_node_is_the_topk_of_its_own_path[small-8-hydra] (each node drafts from its own path) cover that
    siblings' subtrees follow their own depth-1 token."""
    hydra = Hydra(num_heads=2)
    params = _random_heads(hydra, target)
    rows = 64  # fractions below are over rows: enough of them that the thresholds are not a coin toss
    ctx = _context(hydra, batch=rows)
    base = hydra.base_state(ctx)
    under = [hydra.head_logits(params, target, 1, base, jnp.stack([ctx.root, jnp.full_like(ctx.root, tok)], -1))
             for tok in (3, 77)]
    assert (np.abs(np.asarray(under[0] - under[1])).max(-1) > 1e-3).all()  # every row's drafts move
    moved = (jax.lax.top_k(under[0], 2)[1] != jax.lax.top_k(under[1], 2)[1]).any(-1)
    assert moved.mean() >= 0.5, moved  # and most rows' top-2 proposals change

    spec = TreeSpec(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)))
    children = np.asarray(hydra.propose(params, target, ctx, spec, jax.random.key(0)).tokens)[:, 4:].reshape(rows, 3, 2)
    differ = (children[:, 0] != children[:, 1]).any(-1) | (children[:, 1] != children[:, 2]).any(-1)
    assert differ.mean() >= 0.5, differ  # siblings' subtrees differ (never for Medusa, below)
    medusa = Medusa(num_heads=2)
    mparams = medusa.init(jax.random.key(1), target)
    mparams = mparams | {"w": jax.random.normal(jax.random.key(2), mparams["w"].shape) * 0.3}
    mchildren = np.asarray(medusa.propose(mparams, target, ctx, spec, jax.random.key(0)).tokens)[:, 4:]
    mchildren = mchildren.reshape(rows, 3, 2)
    assert (mchildren == mchildren[:, :1]).all()


def test_prefix_layer_cache_matches_the_whole_sequence(target):
    """Hydra++: prefill, then commits of different accepted counts per row; every head's drafts from the
    incremental prefix state equal the whole-sequence (training) pass's at the same position, path included."""
    hydra = Hydra.plus_plus(num_heads=3)
    params = _random_heads(hydra, target)
    tokens, hidden = sequence(target, batch=2, length=40)
    full = hydra.draft_logits(params, target, tokens, hidden)  # [B, T, K, V]

    def check(state, lengths):  # the root sits at `lengths`; head k's path is tokens lengths .. lengths + k
        at = (lengths - 1)[:, None, None, None]
        for k in range(3):
            path = jnp.take_along_axis(tokens, lengths[:, None] + jnp.arange(k + 1)[None], 1)
            got = hydra.head_logits(params, target, k, state["prefix"], path)
            want = jnp.take_along_axis(full[:, :, k: k + 1], at, 1)[:, 0, 0]
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=2e-4)

    replay_commits(hydra, params, target, tokens, hidden, [7, 4], ([1, 3], [5, 1], [2, 5], [4, 2]), check)


def test_head_k_reads_the_true_path_tokens_t_plus_1_to_t_plus_1_plus_k(target):
    hydra = Hydra(num_heads=3)
    params = _random_heads(hydra, target)
    tokens, hidden = sequence(target, batch=1, length=16)
    base = hydra.draft_logits(params, target, tokens, hidden)
    t = 5
    for pos in range(t + 1, t + 6):
        moved = hydra.draft_logits(params, target, tokens.at[0, pos].add(1), hidden)
        changed = np.abs(np.asarray(moved[0, t] - base[0, t])).max(-1) > 1e-5  # [K]
        assert changed.tolist() == [pos <= t + 1 + k for k in range(3)], pos


@pytest.mark.parametrize("prefix_layer", [False, True])
@default_cases('True')
def test_loss_positions(target, prefix_layer):
    """With only label position j in the mask: head k's loss reaches the hidden states at j - 2 - k (and, with
    the causal prefix layer, earlier ones, never later), and its teacher term the target's logits at j - 1."""
    hydra = Hydra(num_heads=3, prefix_layer=prefix_layer, lm_weight=1.0, teacher_weight=1.0)
    params = _random_heads(hydra, target)
    tokens, hidden = sequence(target, batch=1, length=12)
    logits = jax.random.normal(jax.random.key(8), (1, 12, CONFIG.vocab_size))
    j = 9
    batch = {"tokens": tokens, "loss_mask": jnp.zeros_like(tokens).at[0, j].set(1)}

    @jax.jit
    def per_head(h, lg):  # [K] each head's ground-truth and teacher losses
        metrics = hydra.loss(params, target, batch, Output(h, lg, None))[1]
        return jnp.stack([metrics[f"head{k}/loss"] for k in range(3)]), jnp.stack(
            [metrics[f"head{k}/teacher"] for k in range(3)])

    to_hidden = np.abs(np.asarray(jax.jacrev(lambda h: per_head(h, logits)[0])(hidden))).sum(-1)[:, 0]  # [K, T]
    to_logits = np.abs(np.asarray(jax.jacrev(lambda lg: per_head(hidden, lg)[1])(logits))).sum(-1)[:, 0]
    for k in range(3):
        assert np.flatnonzero(to_hidden[k]).tolist() == (list(range(j - 1 - k)) if prefix_layer else [j - 2 - k])
        assert np.flatnonzero(to_logits[k]).tolist() == [j - 1]


def test_embedding_noise_only_with_a_training_rng(target):
    tokens, hidden = sequence(target, batch=2, length=12)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}
    out = Output(hidden, Transformer(CONFIG).apply({"params": target.params}, hidden, method=Transformer.logits), None)
    losses = {}
    for alpha in (0.0, 75.0):
        hydra = Hydra(num_heads=2, alpha_noise=alpha)
        params = _random_heads(hydra, target)
        losses[alpha] = [float(hydra.loss(params, target, batch | rng, out)[0])
                         for rng in ({}, {"rng": jax.random.key(0)}, {"rng": jax.random.key(1)})]
    assert losses[0.0][0] == losses[0.0][1] == losses[0.0][2]
    plain, noisy0, noisy1 = losses[75.0]
    assert plain == losses[0.0][0] and noisy0 != plain and noisy1 != noisy0


@pytest.mark.parametrize("variant", ["hydra", "hydra++", pytest.param("hydra+noise", marks=pytest.mark.slow)])
@default_cases('hydra++')
@pytest.mark.slow
def test_training_lowers_the_loss(target, variant):
    """Under -m slow: test_greedy_hydra_equals_ar[hydra++-trained-mc_sim_7b_63]'s fitted heads (`fitted_heads`
    asserts head3 top-1 > 0.9 after 250 steps) cover that training lowers the loss."""
    assert_trains(Hydra(alpha_noise=75.0) if variant == "hydra+noise" else VARIANTS[variant], target)


@pytest.fixture(scope="module")
def trained(target):
    """variant -> fitted heads, fitted on first use. Hydra++'s teacher-only loss fits a random target's
    near-flat distributions more slowly than the ground-truth loss (top-1 ~0.87 at 150 steps, ~0.95 at 250)."""
    fitted = {}

    def get(variant: str) -> dict:
        if variant not in fitted:
            fitted[variant] = fitted_heads(VARIANTS[variant], target, steps=250 if variant == "hydra++" else 150)
        return fitted[variant]

    return get


# Every (variant, heads, tree preset) runs; the default run keeps a spread of trees, `-m slow` adds the rest.
FAST_GREEDY = {("trained", "mc_sim_7b_63"), ("untrained", "chain-1")}


@pytest.mark.parametrize(("variant", "heads", "tree"), [
    pytest.param(v, h, t, marks=() if (h, t) in FAST_GREEDY else pytest.mark.slow)
    for v in sorted(VARIANTS) for h in ("untrained", "trained") for t in sorted(PRESETS)])
@default_cases('hydra++-trained-mc_sim_7b_63')
def test_greedy_hydra_equals_ar(target, trained, variant, heads, tree):
    """By default Hydra++'s trained heads run on the 63-node tree; plain Hydra's trained heads decode losslessly
    by default in test_shipped_heads_decode_losslessly_with_long_paths[hydra-searched] (the shipped heads are plain
    Hydra), and untrained heads and other trees take the same decode code path."""
    hydra = VARIANTS[variant]
    params = trained(variant) if heads == "trained" else _random_heads(hydra, target)
    assert_greedy_lossless(target, hydra, params, PRESETS[tree], heads == "trained")


def test_hydra_plus_plus_generation_compiles_once(target):
    hydra = VARIANTS["hydra++"]
    params = _random_heads(hydra, target)
    assert_compiles_once(target.params, hydra, params, PRESETS["small-16"])


def test_checkpoint_keeps_the_variant(target, tmp_path):
    hydra = Hydra.plus_plus(num_heads=2)
    params = _random_heads(hydra, target)
    save_draft(tmp_path / "heads", "hydra", hydra, params, CONFIG)
    method, loaded, restored = load_draft(tmp_path / "heads", CONFIG, target.params)
    assert (method, loaded) == ("hydra", hydra) and loaded.prefix_layer and loaded.num_layers == 4
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, restored)


def test_refuses_a_tree_deeper_than_its_heads(target):
    hydra = Hydra(num_heads=2)
    tokens, lengths = pad_prompts(PROMPTS)
    with pytest.raises(ValueError, match="tree depth 4 needs 4 heads"):
        speculative_generate(target.params, hydra.init(jax.random.key(0), target), tokens, lengths,
                             jax.random.key(0), config=CONFIG, drafter=hydra, tree=PRESETS["chain-4"],
                             max_new_tokens=8, cache_size=64)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="not all 0"):
        Hydra(lm_weight=0.0, teacher_weight=0.0)
    with pytest.raises(ValueError, match="num_layers"):
        Hydra(num_layers=0)
    with pytest.raises(ValueError, match="alpha_noise"):
        Hydra(alpha_noise=-1.0)
    plus = dataclasses.asdict(Hydra.plus_plus())
    assert plus == {"num_heads": 4, "num_layers": 4, "prefix_layer": True, "lm_weight": 0.0, "teacher_weight": 1.0,
                    "alpha_noise": 0.0, "draft_vocab": ()}
