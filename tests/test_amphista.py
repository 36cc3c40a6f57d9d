"""Amphista: adaptation caches match the whole-sequence pass, heads see each other, every ablation is its
own code path and trains, and trained heads decode losslessly with long accepted paths."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.drafters import Amphista
from amphista_jax.engine.decode import pad_prompts, speculative_generate
from amphista_jax.models.llama import Output, Transformer, init_params
from amphista_jax.models.target import Target
from amphista_jax.trees.names import PRESETS
from tests.helpers import (
    CONFIG,
    PROMPTS,
    assert_greedy_lossless,
    assert_trains,
    default_cases,
    fitted_heads,
    replay_commits,
    sequence,
)


@pytest.fixture(scope="module")
def target():
    return Target(CONFIG, init_params(CONFIG, jax.random.key(0)))


def _random_heads(amphista: Amphista, target: Target, seed: int = 1) -> dict:
    """Initialised params with the zero-initialised head MLPs made random (so every path is exercised)."""
    params = amphista.init(jax.random.key(seed), target)
    w = jax.random.normal(jax.random.key(seed + 1), params["head_w"].shape) * 0.2
    return params | {"head_w": w}


def test_adaptation_caches_match_the_whole_sequence(target):
    """Prefill, then commits of different accepted counts per row: the drafts read from the incremental
    caches equal the drafts of the whole-sequence (training) pass at the same positions."""
    amphista = Amphista(num_heads=4)
    params = _random_heads(amphista, target)
    tokens, hidden = sequence(target, batch=2, length=40)
    full = amphista.draft_logits(params, target, tokens, hidden)  # [B, T, K, V]

    def check(state, lengths):  # drafts from the pair at position lengths - 1
        got = amphista.head_logits(params, target, state["adapted"])
        want = jnp.take_along_axis(full, (lengths - 1)[:, None, None, None], 1)[:, 0]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=2e-4)

    replay_commits(amphista, params, target, tokens, hidden, [7, 4], ([1, 3], [5, 1], [2, 5], [4, 2]), check)


@pytest.mark.parametrize("auto_embedding", [True, False])
def test_heads_see_each_other_only_through_the_auto_embedding_block(target, auto_embedding):
    amphista = Amphista(num_heads=4, auto_embedding=auto_embedding)
    params = _random_heads(amphista, target)
    adapted = jax.random.normal(jax.random.key(5), (3, amphista.stages, CONFIG.hidden_size))
    base = amphista.head_logits(params, target, adapted)
    nudged = params | {"head_b": params["head_b"].at[1].add(0.5)}  # only head 1's own MLP changes
    moved = np.abs(np.asarray(amphista.head_logits(params=nudged, target=target, adapted=adapted) - base)).max((0, 2))
    assert moved[1] > 1e-3
    others = moved[[0, 2, 3]]
    assert (others > 1e-4).all() if auto_embedding else (others == 0).all()


def test_each_stage_feeds_its_own_half_of_the_heads(target):
    """With two stages, heads 0-1 read stage 1 and heads 2-3 stage 2 (before the auto-embedding block)."""
    amphista = Amphista(num_heads=4, auto_embedding=False)
    params = _random_heads(amphista, target)
    adapted = jax.random.normal(jax.random.key(6), (2, 2, CONFIG.hidden_size))
    base = amphista.head_logits(params, target, adapted)
    moved = amphista.head_logits(params, target, adapted.at[:, 1].add(1.0)) - base
    change = np.abs(np.asarray(moved)).max((0, 2))
    assert (change[:2] == 0).all() and (change[2:] > 1e-3).all()


def test_fresh_full_rank_heads_start_from_the_target_lm_head(target):
    amphista = Amphista(num_heads=2, staged_adaptation=False, auto_embedding=False)
    params = amphista.init(jax.random.key(0), target)
    hidden = jax.random.normal(jax.random.key(1), (3, 1, CONFIG.hidden_size))
    logits = amphista.head_logits(params, target, hidden)  # zero head MLPs: identity
    want = Transformer(CONFIG).apply({"params": target.params}, hidden[:, 0], method=Transformer.logits)
    for k in range(2):
        np.testing.assert_allclose(np.asarray(logits[:, k]), np.asarray(want), atol=1e-4)
    low = Amphista(num_heads=2, staged_adaptation=False, auto_embedding=False, lm_head_rank=CONFIG.hidden_size)
    np.testing.assert_allclose(np.asarray(low.head_logits(low.init(jax.random.key(0), target), target, hidden)),
                               np.asarray(logits), atol=1e-3)  # full-rank SVD factors reproduce it


ABLATIONS = {
    "amphista": {},
    "w/o auto-embedding": {"auto_embedding": False},
    "w/o position-encoding": {"positional_encoding": False},
    "w/o staged-adaptation": {"staged_adaptation": False},
    "one adaptation layer": {"adaptation_stages": 1},
    "w/o sampled-token": {"sampled_token": False},
    "three stages": {"adaptation_stages": 3},
    "amphista-alpha": {"auto_embedding_layers": 2},
    "low-rank lm heads": {"lm_head_rank": 16},
    "every change at once": {"positional_encoding": False, "adaptation_stages": 3, "sampled_token": False,
                             "auto_embedding_layers": 2, "lm_head_rank": 16},
}


def _param_summary(params: dict) -> dict[str, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(path): tuple(x.shape) for path, x in flat}


def test_ablations_change_the_parameter_tree_as_the_paper_describes(target):
    shapes = {name: _param_summary(jax.eval_shape(Amphista(**kw).init, jax.random.key(0), target))
              for name, kw in ABLATIONS.items()}
    full = shapes["amphista"]
    d, v = CONFIG.hidden_size, CONFIG.vocab_size
    assert {"['fc0']['kernel']", "['fc1']['kernel']", "['pe']", "['lm_head']"} <= set(full)
    assert full["['fc0']['kernel']"] == (2 * d, d) and full["['pe']"] == (4, d) and full["['lm_head']"] == (4, d, v)
    assert not any(k.startswith(("['auto_embedding']", "['pe']")) for k in shapes["w/o auto-embedding"])
    assert "['pe']" not in shapes["w/o position-encoding"] and any(
        k.startswith("['auto_embedding']") for k in shapes["w/o position-encoding"])
    assert not any(k.startswith(("['fc", "['sal")) for k in shapes["w/o staged-adaptation"])
    one = shapes["one adaptation layer"]
    assert "['fc1']['kernel']" not in one and any(k.startswith("['sal0']") for k in one)
    assert shapes["w/o sampled-token"]["['fc0']['kernel']"] == (d, d)
    assert "['fc2']['kernel']" in shapes["three stages"]
    layers = {k: s[0] for k, s in shapes["amphista-alpha"].items() if k.startswith("['auto_embedding']")}
    assert set(layers.values()) == {2}
    assert shapes["low-rank lm heads"]["['lm_a']"] == (4, d, 16) and "['lm_head']" not in shapes["low-rank lm heads"]


# The default run trains the full model and one with every change at once; each single change on its own trains
# under `-m slow`.
FAST_ABLATIONS = {"amphista", "every change at once"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST_ABLATIONS else pytest.mark.slow)
                                  for n in sorted(ABLATIONS)])
@default_cases('every change at once')
@pytest.mark.slow
def test_every_ablation_trains(target, name):
    """Under -m slow: the `trained` fixture of test_greedy_amphista_equals_ar[trained-mc_sim_7b_63] (`fitted_heads`
    asserts head3 top-1 > 0.9) covers that training lowers the loss, and
    test_ablations_change_the_parameter_tree_as_the_paper_describes each ablation's own parameters."""
    assert_trains(Amphista(**ABLATIONS[name]), target)


def test_alignment_term_reads_the_target_logits_one_position_before_the_label(target):
    """With only label position j in the mask, head k's alignment loss depends on the target's logits at
    j - 1 (the target's own prediction of token j) and nowhere else."""
    amphista = Amphista(num_heads=3, lambda_lm=0.0)
    params = _random_heads(amphista, target)
    tokens, hidden = sequence(target, batch=1, length=12)
    j = 9
    batch = {"tokens": tokens, "loss_mask": jnp.zeros_like(tokens).at[0, j].set(1)}
    logits = jax.random.normal(jax.random.key(8), (1, 12, CONFIG.vocab_size))
    for k in range(3):
        def align(lg, k=k):
            return amphista.loss(params, target, batch, Output(hidden, lg, None))[1][f"head{k}/alignment"]

        grad = np.abs(np.asarray(jax.jit(jax.grad(align))(logits))).sum(-1)[0]
        assert np.flatnonzero(grad).tolist() == [j - 1]


@pytest.fixture(scope="module")
def trained(target):
    amphista = Amphista(num_heads=4)
    return amphista, fitted_heads(amphista, target)


FAST_GREEDY = {("trained", "mc_sim_7b_63"), ("trained", "chain-4"), ("untrained", "small-8"), ("untrained", "chain-1")}


@pytest.mark.parametrize(("heads", "tree"), [
    pytest.param(h, t, marks=() if (h, t) in FAST_GREEDY else pytest.mark.slow)
    for h in ("untrained", "trained") for t in sorted(PRESETS)])
@default_cases('trained-mc_sim_7b_63')
def test_greedy_amphista_equals_ar(target, trained, tree, heads):
    """By default only trained heads on the 63-node tree run: untrained heads and the other trees take the same
    decode code path (test_a_shallow_tree_projects_only_its_heads covers trees shallower than the heads)."""
    amphista, params = trained if heads == "trained" else (Amphista(num_heads=4), None)
    params = params if params is not None else _random_heads(amphista, target)
    assert_greedy_lossless(target, amphista, params, PRESETS[tree], heads == "trained")


def test_amphista_refuses_a_tree_deeper_than_its_heads(target):
    amphista = Amphista(num_heads=2)
    tokens, lengths = pad_prompts(PROMPTS)
    with pytest.raises(ValueError, match="tree depth 4 needs 4 heads"):
        speculative_generate(target.params, amphista.init(jax.random.key(0), target), tokens, lengths,
                             jax.random.key(0), config=CONFIG, drafter=amphista, tree=PRESETS["chain-4"],
                             max_new_tokens=8, cache_size=64)


def test_settings_are_validated():
    with pytest.raises(ValueError, match="adaptation_stages"):
        Amphista(num_heads=4, adaptation_stages=5)
    with pytest.raises(ValueError, match="not all 0"):
        Amphista(lambda_alignment=0.0, lambda_lm=0.0)
    assert dataclasses.asdict(Amphista())["adaptation_stages"] == 2


def test_a_shallow_tree_projects_only_its_heads(target):
    """The auto-embedding block sees all K heads either way; `depth` only drops the later vocabulary projections."""
    amphista = Amphista()
    params = _random_heads(amphista, target)
    adapted = jax.random.normal(jax.random.key(5), (2, amphista.adaptation_stages, CONFIG.hidden_size))
    full = amphista.head_logits(params, target, adapted)
    np.testing.assert_allclose(np.asarray(amphista.head_logits(params, target, adapted, 2)), np.asarray(full[:, :2]),
                               rtol=1e-6, atol=1e-6)
