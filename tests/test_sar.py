"""Semi-autoregressive drafting: each node is the top-k of `q0` on its own path, training drafts equal drafts
from scratch and never read their label, Eq. 6 by hand, the loss trains, decoding is lossless and compiles once,
checkpoints keep the encoder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.drafters import SemiAutoregressive
from amphista_jax.drafters.base import DraftContext
from amphista_jax.drafters.io import load_draft, save_draft
from amphista_jax.drafters.sar import _SARNet
from amphista_jax.engine.decode import pad_prompts, speculative_generate
from amphista_jax.models.llama import init_params
from amphista_jax.models.target import Target
from amphista_jax.trees.names import PRESETS
from amphista_jax.trees.tree import tree_arrays
from tests.helpers import (
    CONFIG,
    PROMPTS,
    assert_compiles_once,
    assert_greedy_lossless,
    assert_trains,
    default_cases,
    fitted_heads,
    sequence,
)

ENCODERS = {"simplified": SemiAutoregressive(encoder="simplified"), "lstm": SemiAutoregressive(encoder="lstm")}


@pytest.fixture(scope="module")
def target():
    return Target(CONFIG, init_params(CONFIG, jax.random.key(0)))


def _context(batch: int, seed: int = 4) -> DraftContext:
    hidden = jax.random.normal(jax.random.key(seed), (batch, CONFIG.hidden_size))
    root = jax.random.randint(jax.random.key(seed + 1), (batch,), 0, CONFIG.vocab_size)
    return DraftContext(hidden, root, jnp.zeros((batch,), jnp.int32), ())


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
@pytest.mark.parametrize("tree", ["small-8", "mc_sim_7b_63"])
@default_cases('mc_sim_7b_63-lstm')
def test_every_node_is_the_topk_of_its_own_path(target, encoder, tree):
    """Node-by-node reference: node n's token is rank `rank[n]` of `q0` on the encoder run from scratch over n's
    own path (root .. parent). By default the LSTM encoder on the 63-node tree runs: the tree walk reaches the
    encoder only through `_SARNet.empty/step/encoded`, which test_simplified_encoder_is_eq6_by_hand checks for the
    simplified encoder (and test_greedy_sar_equals_ar[simplified-trained-mc_sim_7b_63] decodes with it)."""
    sar = ENCODERS[encoder]
    params = sar.init(jax.random.key(1), target)
    arrays = tree_arrays(PRESETS[tree])
    ctx = _context(batch=2)
    tokens = np.asarray(jax.jit(lambda p, c: sar.propose(p, target, c, PRESETS[tree], jax.random.key(0)))(
        params, ctx).tokens)
    assert (tokens[:, 0] == np.asarray(ctx.root)).all()
    parent, depth, rank = (np.asarray(a) for a in (arrays.parent, arrays.depth, arrays.rank))
    path_logits = jax.jit(lambda p, base, path: sar.path_logits(p, target, base, path))
    for d in range(1, PRESETS[tree].depth + 1):
        nodes = np.flatnonzero(np.asarray(arrays.valid) & (depth == d))
        paths = np.zeros((len(nodes), d), np.int64)  # node ids root .. parent of every node of depth d
        for row, node in enumerate(nodes):
            for i in range(d - 1, -1, -1):
                node = parent[node]
                paths[row, i] = node
        logits = path_logits(params, ctx.hidden[:, None], jnp.asarray(tokens[:, paths]))  # [B, C, V]
        top = np.asarray(jax.lax.top_k(logits, int(rank[nodes].max()) + 1)[1])
        np.testing.assert_array_equal(tokens[:, nodes], top[:, np.arange(len(nodes)), rank[nodes]])


@pytest.mark.parametrize("encoder", sorted(ENCODERS))
def test_training_drafts_are_drafts_from_scratch_and_never_read_their_label(target, encoder):
    """Depth j at position t equals `q0(h_t, h_q(tokens t + 1 .. t + 1 + j))`, and only those tokens move it."""
    sar = ENCODERS[encoder]
    params = sar.init(jax.random.key(1), target)
    tokens, hidden = sequence(target, batch=2, length=16)
    full = sar.draft_logits(params, target, tokens, hidden)  # [B, T, K, V]
    t = 5
    for j in range(sar.num_heads):
        scratch = sar.path_logits(params, target, hidden[:, t], tokens[:, t + 1: t + 2 + j])
        np.testing.assert_allclose(np.asarray(full[:, t, j]), np.asarray(scratch), atol=1e-5, rtol=1e-5)
    for pos in range(t, t + sar.num_heads + 2):
        moved = sar.draft_logits(params, target, tokens.at[0, pos].add(1), hidden)
        changed = np.abs(np.asarray(moved[0, t] - full[0, t])).max(-1) > 1e-6  # [K]
        assert changed.tolist() == [t + 1 <= pos <= t + 1 + j for j in range(sar.num_heads)], pos


def test_simplified_encoder_is_eq6_by_hand(target):
    """h_q = sum_l alpha_l MLP(e(d_l)) / sum_l alpha_l with alpha = sigmoid(alpha_logits), MLP = Dense, SiLU, Dense."""
    sar = SemiAutoregressive(num_heads=3)
    params = sar.init(jax.random.key(1), target)
    params = params | {"alpha_logits": jnp.asarray([-1.0, 0.5, 2.0])}
    path = jnp.asarray([[3, 50, 7]])
    net = _SARNet(sar, CONFIG)
    carry = net.apply({"params": params}, (1,), method=_SARNet.empty)
    for position in range(3):
        carry = net.apply({"params": params}, carry, target.embed(path[:, position]), position, method=_SARNet.step)
    got = net.apply({"params": params}, carry, method=_SARNet.encoded)

    def dense(name, x):
        return x @ params[name]["kernel"] + params[name]["bias"]

    e = np.asarray(target.embed(path[0]))  # [3, D]
    mlp = np.asarray(dense("mlp_out", jax.nn.silu(dense("mlp_in", e))))  # [3, H/2]
    alpha = 1 / (1 + np.exp(-np.asarray([-1.0, 0.5, 2.0])))
    np.testing.assert_allclose(np.asarray(got[0]), (alpha[:, None] * mlp).sum(0) / alpha.sum(), rtol=1e-5, atol=1e-6)


def test_vocab_projection_starts_as_the_target_lm_head_when_shapes_allow(target):
    d = CONFIG.hidden_size
    matched = SemiAutoregressive(width=d // 2).init(jax.random.key(0), target)["lm_head"]
    np.testing.assert_array_equal(np.asarray(matched), np.asarray(target.lm_head()))
    paper = SemiAutoregressive().init(jax.random.key(0), target)["lm_head"]  # W = H/4: [H/2, V], random
    assert paper.shape == (d // 2, CONFIG.vocab_size) and np.isfinite(np.asarray(paper)).all()


@pytest.mark.slow  # the default run trains both encoders to top-1 > 0.9 in `trained` (`fitted_heads`)
@pytest.mark.parametrize("encoder", sorted(ENCODERS))
def test_training_lowers_the_loss(target, encoder):
    assert_trains(ENCODERS[encoder], target)


@pytest.fixture(scope="module")
def trained(target):
    fitted = {}

    def get(encoder: str) -> dict:
        if encoder not in fitted:
            fitted[encoder] = fitted_heads(ENCODERS[encoder], target)
        return fitted[encoder]

    return get


FAST_GREEDY = {("simplified", "trained", "mc_sim_7b_63"), ("lstm", "trained", "chain-4")}


@pytest.mark.parametrize(("encoder", "heads", "tree"), [
    pytest.param(e, h, t, marks=() if (e, h, t) in FAST_GREEDY else pytest.mark.slow)
    for e in sorted(ENCODERS) for h in ("untrained", "trained") for t in sorted(PRESETS)])
def test_greedy_sar_equals_ar(target, trained, encoder, heads, tree):
    sar = ENCODERS[encoder]
    params = trained(encoder) if heads == "trained" else sar.init(jax.random.key(1), target)
    assert_greedy_lossless(target, sar, params, PRESETS[tree], heads == "trained")


def test_generation_compiles_once(target):
    sar = ENCODERS["lstm"]
    params = sar.init(jax.random.key(1), target)
    assert_compiles_once(target.params, sar, params, PRESETS["small-16"])


def test_checkpoint_keeps_the_encoder(target, tmp_path):
    sar = SemiAutoregressive(num_heads=3, encoder="lstm", width=8)
    params = sar.init(jax.random.key(0), target)
    save_draft(tmp_path / "heads", "sar", sar, params, CONFIG)
    method, loaded, restored = load_draft(tmp_path / "heads", CONFIG, target.params)
    assert (method, loaded) == ("sar", sar)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, restored)


def test_refuses_a_tree_deeper_than_its_depth(target):
    sar = SemiAutoregressive(num_heads=2)
    tokens, lengths = pad_prompts(PROMPTS)
    with pytest.raises(ValueError, match="tree depth 4 needs 4 heads"):
        speculative_generate(target.params, sar.init(jax.random.key(0), target), tokens, lengths,
                             jax.random.key(0), config=CONFIG, drafter=sar, tree=PRESETS["chain-4"],
                             max_new_tokens=8, cache_size=64)


@pytest.mark.parametrize(("settings", "message"), [
    (dict(num_heads=0), "num_heads"), (dict(encoder="gru"), "encoder"), (dict(width=0), "width")])
def test_settings_are_validated(settings, message):
    with pytest.raises(ValueError, match=message):
        SemiAutoregressive(**settings)
