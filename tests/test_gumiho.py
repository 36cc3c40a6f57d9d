"""Gumiho: parallel heads independent of each other, the lossless Full Tree Attention against the published
form (which commits tokens AR would not), trees within budget, training, and lossless decoding (greedy and
sampled) that compiles once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.drafters import Gumiho
from amphista_jax.drafters.base import Proposal, accepted_tokens
from amphista_jax.drafters.io import load_draft, save_draft
from amphista_jax.engine.decode import generate, pad_prompts, spec_init, spec_propose, speculative_generate
from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.models.llama import Transformer, init_params
from amphista_jax.models.target import Target
from amphista_jax.trees.growth import DraftedTree, dynamic_tree, extend_short_paths
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.tree import TreeError, arrays_from_parents
from amphista_jax.trees.verify import AcceptanceConfig, verify
from tests.helpers import (
    CONFIG,
    PROMPTS,
    assert_compiles_once,
    assert_greedy_lossless,
    assert_trains,
    fitted_heads,
)

SMALL = Gumiho(top_k=3, fta_nodes=6)  # small trees for the tiny target
SMALL_TREE = dynamic_tree(20, 5, 4)


@pytest.fixture(scope="module")
def target():
    return Target(CONFIG, init_params(CONFIG, jax.random.key(0)))


def _random_heads(gumiho: Gumiho, target: Target, seed: int = 1) -> dict:
    """Initialised params with every (zero-initialised) MLP weight made random, so the heads draft."""
    params = gumiho.init(jax.random.key(seed), target)
    mlps = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(seed + 1), x.shape) / np.sqrt(x.shape[0]),
                        params["mlps"])
    return params | {"mlps": mlps}


@pytest.fixture(scope="module")
def trained(target):
    """Fitted on first use (no feature noise: see test_eagle's fixture)."""
    fitted = []

    def get() -> dict:
        if not fitted:
            fitted.append(fitted_heads(Gumiho(feature_noise=0.0, top_k=3), target, metric="head0/top1"))
        return fitted[0]

    return get


def test_parallel_heads_depend_only_on_their_own_weights(target):
    """Perturbing one MLP head changes that head's depth and no other."""
    gumiho = Gumiho()
    params = _random_heads(gumiho, target)
    x = jax.random.normal(jax.random.key(7), (3, 2 * CONFIG.hidden_size))
    before = gumiho._heads(params, x)  # [3, H, D]
    for h in range(gumiho.mlp_heads):
        moved = jax.tree_util.tree_map_with_path(
            lambda path, w, h=h: w + 0.5 if f"head{h}_" in jax.tree_util.keystr(path) else w, params["mlps"])
        after = gumiho._heads(params | {"mlps": moved}, x)
        changed = np.abs(np.asarray(after - before)).max(axis=(0, 2)) > 0
        assert changed.tolist() == [i == h for i in range(gumiho.mlp_heads)]


def test_extend_short_paths_literal():
    """Root -> a (score -1), b (-2); a -> c (-3) at depth 2; b -> d (-2.5) -> e (-4) to depth 3. The one short
    leaf is c (depth 2); depth 3's best node is e, so c gets one child with e's token; of 3 extra slots the
    other two are padding."""
    tree = DraftedTree(tokens=jnp.asarray([[9, 11, 12, 13, 14, 15]]), parent=jnp.asarray([[0, 0, 0, 1, 2, 4]]),
                       score=jnp.asarray([[0.0, -1.0, -2.0, -3.0, -2.5, -4.0]]),
                       depth=jnp.asarray([[0, 1, 1, 2, 2, 3]]))
    tokens, parent, valid = extend_short_paths(tree, extra=3, depth=3)
    assert tokens[0].tolist() == [9, 11, 12, 13, 14, 15, 15, 0, 0]
    assert parent[0].tolist() == [0, 0, 0, 1, 2, 4, 3, 0, 0]
    assert valid[0].tolist() == [True] * 7 + [False] * 2
    # Root -> a (a leaf at depth 1), b -> d -> e: a needs two nodes (depths 2 and 3); one slot is not enough.
    tree = DraftedTree(tokens=jnp.asarray([[9, 11, 12, 14, 15]]), parent=jnp.asarray([[0, 0, 0, 2, 3]]),
                       score=jnp.asarray([[0.0, -1.0, -2.0, -2.5, -4.0]]), depth=jnp.asarray([[0, 1, 1, 2, 3]]))
    assert extend_short_paths(tree, extra=1, depth=3)[2][0].tolist() == [True] * 5 + [False]
    tokens, parent, valid = extend_short_paths(tree, extra=2, depth=3)
    assert tokens[0, 5:].tolist() == [14, 15] and parent[0, 5:].tolist() == [1, 5] and bool(valid.all())


def _uncached_logits(params, prompt, node_tokens, node_depth, tree_mask):
    """The target over the prompt then the tree's nodes, each node seeing the prompt and `tree_mask [N, N]`."""
    t, n = len(prompt), len(node_tokens)
    mask = np.zeros((t + n, t + n), bool)
    mask[:t, :t] = np.tril(np.ones((t, t), bool))
    mask[t:, :t] = True
    mask[t:, t:] = tree_mask
    tokens = jnp.asarray(list(prompt) + list(node_tokens))[None]
    positions = jnp.asarray(list(range(t)) + [t + d for d in node_depth])[None]
    return Transformer(CONFIG).apply({"params": params}, tokens, positions, None, jnp.asarray(mask)[None]).logits[0, t:]


@pytest.mark.slow
def test_published_fta_commits_tokens_ar_would_not_and_ours_does_not(target):
    """Root r (the target's next token), a = the right depth-1 token, b = a wrong one, c = the right depth-2
    token drafted under b. The short path r -> a borrows c. Published FTA: the path [r, a, c] reads c's logits
    computed under b, and a's row attends to c. Ours: c becomes a new node under a. Greedy acceptance on each
    prompt; AR is the reference. Under -m slow: test_extend_short_paths_literal pins our extension (a new node under
    the short path's leaf), test_proposals_stay_in_budget_and_fta_lengthens_short_paths finds it in real proposals,
    and test_greedy_gumiho_equals_ar[untrained-True-budget0] decodes AR's tokens with it."""
    tokens, lengths = pad_prompts(PROMPTS)
    ar = np.asarray(generate(target.params, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=5,
                             cache_size=32).tokens)
    wrong_published = 0
    for row, prompt in enumerate(PROMPTS):
        y = ar[row]  # y[0] is the root
        r, a, b, c = int(y[0]), int(y[1]), int(y[1] + 1) % CONFIG.vocab_size, int(y[2])
        depth = [0, 1, 1, 2]
        published = np.eye(4, dtype=bool)
        published[1:, 0] = True
        published[3, 2] = True  # c under b
        published[1, 3] = True  # the short path's leaf attends to the borrowed node
        logits = np.asarray(_uncached_logits(target.params, prompt, [r, a, b, c], depth, published))
        committed, node = [], 0
        for nxt, tok in ((1, a), (3, c)):  # the path r -> a -> (borrowed) c
            if logits[node].argmax() != tok:
                break
            committed.append(tok)
            node = nxt
        committed.append(int(logits[node].argmax()))
        wrong_published += committed != y[1: len(committed) + 1].tolist()
        # Ours: extend the short path with a new node under a; verify the whole tree on its own ancestors.
        drafted = DraftedTree(jnp.asarray([[r, a, b, c]]), jnp.asarray([[0, 0, 0, 2]]),
                              jnp.asarray([[0.0, -1.0, -2.0, -2.5]]), jnp.asarray([depth]))
        ext_tokens, parent, valid = extend_short_paths(drafted, extra=1, depth=2)
        tree = arrays_from_parents(parent, valid, depth=2, num_paths=2, max_children=2)
        assert ext_tokens[0].tolist() == [r, a, b, c, c] and parent[0].tolist() == [0, 0, 0, 2, 1]
        logits = _uncached_logits(target.params, prompt, ext_tokens[0].tolist(), tree.depth[0].tolist(),
                                  np.asarray(tree.mask[0]))
        verdict = verify(ext_tokens, logits[None], tree, SamplingConfig(), AcceptanceConfig(), jax.random.key(0))
        n = int(verdict.n_accepted[0])
        ours = np.asarray(accepted_tokens(Proposal(ext_tokens, tree), verdict))[0, :n]
        assert n == 3 and ours.tolist() == y[1:4].tolist()  # a, the new c, and the right bonus token
    assert wrong_published > 0  # the published form commits a token the target would not have


def test_proposals_stay_in_budget_and_fta_lengthens_short_paths(target):
    settings = DecodeSpec(CONFIG, SMALL, SMALL_TREE, 16)
    params = _random_heads(SMALL, target)
    tokens, lengths = pad_prompts(PROMPTS)
    s = jax.jit(spec_init, static_argnums=(5, 6))(target.params, params, jnp.asarray(tokens), jnp.asarray(lengths),
                                                  jax.random.key(0), 64, settings)
    proposal = jax.jit(spec_propose, static_argnums=3)(target.params, params, s, settings)
    tree = proposal.tree
    n, extra = SMALL_TREE.num_nodes, SMALL.fta_nodes
    parent, valid, depth = np.asarray(tree.parent), np.asarray(tree.valid), np.asarray(tree.depth)
    assert proposal.tokens.shape == (3, n)
    for b in range(3):
        ids = np.flatnonzero(valid[b])[1:]
        assert (parent[b, ids] < ids).all() and depth[b, valid[b]].max() <= SMALL_TREE.depth
        assert valid[b, : n - extra].all()  # the reranked nodes fill the rest of the budget
        assert valid[b, n - extra:].any()  # FTA used some of its slots
        ext = np.flatnonzero(valid[b, n - extra:]) + n - extra
        assert (depth[b, ext] >= 2).all()


@pytest.mark.parametrize(("weights", "fta", "budget"), [
    ("untrained", True, (20, 5, 4)), pytest.param("trained", True, (20, 5, 4), marks=pytest.mark.slow),
    pytest.param("trained", False, (20, 5, 4), marks=pytest.mark.slow),
    # The 63-node budget with trained heads runs by default in test_shipped_heads (Gumiho's shipped heads).
    pytest.param("trained", True, (63, 7, 35), marks=pytest.mark.slow),
    pytest.param("untrained", False, (63, 7, 35), marks=pytest.mark.slow)])
def test_greedy_gumiho_equals_ar(target, trained, weights, fta, budget):
    gumiho = Gumiho(top_k=3, full_tree_attention=fta, fta_nodes=6)
    params = trained() if weights == "trained" else _random_heads(gumiho, target)
    assert_greedy_lossless(target, gumiho, params, dynamic_tree(*budget), weights == "trained")


def test_generation_compiles_once(target):
    params = _random_heads(SMALL, target)
    assert_compiles_once(target.params, SMALL, params, SMALL_TREE)


def test_training_lowers_the_loss(target):
    assert_trains(SMALL, target)


def test_checkpoint_round_trip(target, tmp_path):
    gumiho = Gumiho(top_k=4, full_tree_attention=False, mlp_heads=3)
    params = _random_heads(gumiho, target)
    save_draft(tmp_path / "heads", "gumiho", gumiho, params, CONFIG)
    method, loaded, restored = load_draft(tmp_path / "heads", CONFIG, target.params)
    assert (method, loaded) == ("gumiho", gumiho)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, restored)


def test_settings_and_budgets_are_validated(target):
    with pytest.raises(ValueError, match="top_k"):
        Gumiho(top_k=0)
    with pytest.raises(ValueError, match="feature_noise"):
        Gumiho(feature_noise=-1.0)
    params = _random_heads(SMALL, target)
    tokens, lengths = pad_prompts(PROMPTS)
    for tree, needle in ((dynamic_tree(20, 9, 4), "does not fit Gumiho"), (dynamic_tree(20, 5, 2), "top_k"),
                         (dynamic_tree(20, 2, 4), "does not fit Gumiho")):
        with pytest.raises(TreeError, match=needle):
            speculative_generate(target.params, params, tokens, lengths, jax.random.key(0), config=CONFIG,
                                 drafter=SMALL, tree=tree, max_new_tokens=8, cache_size=64)
