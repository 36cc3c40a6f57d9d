"""Engine v2: trees as per-row device data, and the speculative step as a pure, separately testable function.

A drafter here grows a different random tree for every row and every step (`arrays_from_parents` on
device); the engine must stay lossless (greedy == AR, rejection sampling keeps the target distribution) and
compile once. `spec_step` is checked on states built by `spec_init` and then edited by hand.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from amphista_jax.drafters.base import DraftContext, Proposal, accepted_hidden
from amphista_jax.engine.decode import (
    PromptTooLongError,
    generate,
    pad_prompts,
    spec_init,
    spec_step,
    speculative_generate,
)
from amphista_jax.engine.decode_spec import DecodeSpec, scratch_slots
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import PrefixKV, Transformer, init_params
from amphista_jax.models.target import Extras, Target
from amphista_jax.trees.sampling import SamplingConfig, warp_logits
from amphista_jax.trees.tree import TreeBudget, TreeSpec, arrays_from_parents, batched, chain, children, tree_arrays
from amphista_jax.trees.verify import verify_rejection
from tests.helpers import (
    CHI2_999,
    CONFIG,
    PROMPTS,
    ReferenceOracle,
    chi2_999,
    chi_square,
    count_compiles,
    default_cases,
    reference_rows,
)
from tests.test_trees import random_trees

NEW = 40
BUDGET = TreeBudget(num_nodes=12, depth=4, num_paths=11, max_children=11, num_ranks=11)


def random_parents(rng: jax.Array, batch: int, budget: TreeBudget) -> tuple[jax.Array, jax.Array]:
    """`parent, valid [B, N]`: per row a random number of real nodes (at least one draft), each node's parent
    drawn uniformly among the earlier real nodes that are shallower than the depth budget."""
    n, d = budget.num_nodes, budget.depth
    k_count, k_parent = jax.random.split(rng)
    count = jax.random.randint(k_count, (batch,), 2, n + 1)  # real nodes, root included
    valid = jnp.arange(n)[None] < count[:, None]
    parent = jnp.zeros((batch, n), jnp.int32)
    depth = jnp.zeros((batch, n), jnp.int32)
    for node in range(1, n):
        allowed = (jnp.arange(n)[None] < node) & (depth < d)  # [B, N]
        pick = jax.random.categorical(jax.random.fold_in(k_parent, node), jnp.where(allowed, 0.0, -jnp.inf))
        parent = parent.at[:, node].set(pick)
        depth = depth.at[:, node].set(jnp.take_along_axis(depth, pick[:, None], 1)[:, 0] + 1)
    return parent, valid


@dataclasses.dataclass(frozen=True)
class RandomTrees(ReferenceOracle):
    """Grows a fresh random tree per row and step inside `tree` (a `TreeBudget`). Node tokens come from an
    oracle (`params` = reference rows: prompt + AR continuation) that is right with probability `p_right`,
    else a random token; siblings therefore often disagree, and paths are accepted partway."""

    tree_kinds = (TreeBudget,)
    p_right: float = 0.7
    vocab: int = CONFIG.vocab_size

    def propose(self, params, target, ctx: DraftContext, tree: TreeBudget, rng):
        b = ctx.root.shape[0]
        k_tree, k_right, k_token = jax.random.split(rng, 3)
        parent, valid = random_parents(k_tree, b, tree)
        arrays = arrays_from_parents(parent, valid, depth=tree.depth, num_paths=tree.num_paths,
                                     max_children=tree.max_children, num_ranks=tree.num_ranks)
        pos = jnp.minimum(ctx.lengths[:, None] + arrays.depth, params.shape[1] - 1)  # [B, N]
        right = jnp.take_along_axis(params, pos, axis=1)
        tokens = jnp.where(jax.random.bernoulli(k_right, self.p_right, right.shape), right,
                           jax.random.randint(k_token, right.shape, 0, self.vocab))
        return Proposal(tokens.at[:, 0].set(ctx.root), arrays)


@dataclasses.dataclass(frozen=True)
class ChainOracle(ReferenceOracle):
    """Fills a static chain from the reference rows, each token shifted by `wrong` (0 = always right)."""

    wrong: int = 0

    def propose(self, params, target, ctx: DraftContext, tree: TreeSpec, rng):
        arrays = batched(tree_arrays(tree), ctx.root.shape[0])
        pos = ctx.lengths[:, None] + arrays.depth
        tokens = (jnp.take_along_axis(params, pos, axis=1) + self.wrong) % CONFIG.vocab_size
        return Proposal(tokens.at[:, 0].set(ctx.root), arrays)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(random_trees())
def test_arrays_from_parents_on_device_equal_the_static_layout(spec_pad):
    """Depth, ancestor mask, paths and children built with jnp from parent pointers equal the static layout
    of the same tree (padded nodes and paths included). Under -m slow: test_default_sibling_rank_is_node_order
    checks arrays_from_parents' ranks, depths, paths, children and padding on a hand-made tree, and
    test_random_per_row_trees_decode_losslessly_and_compile_once runs it on device in the decode loop."""
    spec, pad = spec_pad
    extra_paths = pad % 3
    want = tree_arrays(spec, num_nodes=spec.num_nodes + pad, num_paths=spec.num_paths + extra_paths)
    got = jax.jit(arrays_from_parents, static_argnames=("depth", "num_paths", "max_children", "num_ranks"))(
        jnp.asarray(want.parent)[None], jnp.asarray(want.valid)[None], rank=jnp.asarray(want.rank)[None],
        depth=spec.depth, num_paths=spec.num_paths + extra_paths, max_children=spec.max_children,
        num_ranks=spec.num_ranks)
    for field in ("parent", "depth", "rank", "valid", "mask", "paths"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field))[0], getattr(want, field), err_msg=field)
    np.testing.assert_array_equal(children(got), children(batched(want, 1)))


def test_default_sibling_rank_is_node_order():
    # root -> 1, 2, 4; 1 -> 3; node 5 is padding
    got = arrays_from_parents(jnp.asarray([[0, 0, 0, 1, 0, 3]]), jnp.asarray([[1, 1, 1, 1, 1, 0]], bool), depth=2,
                              num_paths=4, max_children=3)
    np.testing.assert_array_equal(got.rank[0], [0, 0, 1, 0, 2, 0])
    np.testing.assert_array_equal(got.depth[0], [0, 1, 1, 2, 1, 0])
    np.testing.assert_array_equal(got.paths[0], [[0, 2, -1], [0, 1, 3], [0, 4, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(children(got)[0, :2], [[1, 2, 4], [3, -1, -1]])
    assert not got.mask[0, 5, :5].any() and not got.mask[0, :5, 5].any()


def test_random_trees_differ_per_row_and_step():
    a, _ = random_parents(jax.random.key(0), 3, BUDGET)
    b, _ = random_parents(jax.random.key(1), 3, BUDGET)
    assert len({tuple(r) for r in np.asarray(a).tolist()}) == 3 and not np.array_equal(a, b)


@pytest.fixture(scope="module")
def target():
    return init_params(CONFIG, jax.random.key(0))


@pytest.fixture(scope="module")
def reference(target):
    tokens, lengths = pad_prompts(PROMPTS)
    ar = generate(target, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=NEW, cache_size=64)
    return ar, reference_rows(ar, PROMPTS, tokens.shape[1] + NEW + BUDGET.num_nodes)


def test_random_per_row_trees_decode_losslessly_and_compile_once(target, reference):
    ar, ref = reference
    kw = dict(config=CONFIG, drafter=RandomTrees(), tree=BUDGET, max_new_tokens=NEW, cache_size=96)
    with count_compiles() as compiles:
        tokens, lengths = pad_prompts(PROMPTS)
        spec = speculative_generate(target, ref, tokens, lengths, jax.random.key(0), **kw)
        again = speculative_generate(target, ref, tokens, lengths, jax.random.key(7), **kw)  # other trees
        jax.block_until_ready(again)
    assert len(compiles) == 1
    for out in (spec, again):
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
        np.testing.assert_array_equal(np.asarray(out.num_tokens), np.asarray(ar.num_tokens))
    accepted = np.asarray(spec.accept_lengths)[:, : int(spec.steps)]
    assert np.asarray(spec.drafted).sum() > 20  # the random trees' drafts are really used
    assert len(set(accepted[accepted > 0].tolist())) >= 3  # partial paths of several lengths
    assert np.asarray(spec.node_hits).sum() > 0 and (np.asarray(spec.node_hits) <= np.asarray(spec.node_tries)).all()


@pytest.mark.slow
def test_random_per_row_trees_keep_the_target_distribution_under_rejection_sampling():
    """Many rows of one prompt at temperature 1 (16-token vocabulary), random tokens on random trees: the
    second generated token's marginal equals the exact one computed from the target. Under -m slow:
    test_speculative.py's test_speculative_sampling_matches_the_target_end_to_end[eagle-2] samples end to end on
    per-row trees, and test_joint_of_the_first_three_tokens_on_random_per_row_trees checks verification on random
    per-row trees."""
    config = tiny_llama_config(vocab_size=16)
    params = jax.tree.map(lambda x: x * 8 if x.ndim >= 2 else x, init_params(config, jax.random.key(5)))
    prompt, rows = [3, 7, 1], 4000
    tokens, lengths = pad_prompts([prompt] * rows, length=4)
    ref = jax.random.randint(jax.random.key(11), (rows, 32), 0, 16)  # the "oracle" knows nothing here
    out = speculative_generate(params, ref, tokens, lengths, jax.random.key(9), config=config,
                               drafter=RandomTrees(p_right=0.0, vocab=16), tree=BUDGET, max_new_tokens=3,
                               cache_size=24, sampling=SamplingConfig(temperature=1.0))
    model = Transformer(config)
    first = jax.nn.softmax(model.apply({"params": params}, jnp.asarray([prompt]), jnp.arange(3)[None]).logits[0, -1])
    seqs = jnp.asarray([prompt + [t] for t in range(16)])
    cond = jax.nn.softmax(model.apply({"params": params}, seqs, jnp.broadcast_to(jnp.arange(4), (16, 4))).logits[:, -1])
    exact = np.asarray(first @ cond)
    assert np.asarray(out.drafted)[:, 1].mean() > 0.1  # the second token often comes from an accepted draft
    assert chi_square(np.bincount(np.asarray(out.tokens[:, 1]), minlength=16), exact / exact.sum()) < CHI2_999[15]


@dataclasses.dataclass(frozen=True)
class Overflowing(RandomTrees):
    """Grows one node more than its budget allows."""

    def propose(self, params, target, ctx, tree, rng):
        return super().propose(params, target, ctx, dataclasses.replace(tree, num_nodes=tree.num_nodes + 1), rng)


def test_a_tree_over_the_budget_is_refused_at_trace_time(target, reference):
    _, ref = reference
    tokens, lengths = pad_prompts(PROMPTS)
    with pytest.raises(ValueError, match="does not fit the tree budget"):
        speculative_generate(target, ref, tokens, lengths, jax.random.key(0), config=CONFIG, drafter=Overflowing(),
                             tree=BUDGET, max_new_tokens=8, cache_size=64)


# spec_step on hand-edited states ---------------------------------------------------------------------------


def _state(target, ref, drafter, eos_ids=()):
    settings = DecodeSpec(CONFIG, drafter, chain(4), NEW, eos_ids=eos_ids, pad_id=-1)
    tokens, lengths = pad_prompts(PROMPTS)
    state = spec_init(target, ref, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0), 96, settings)
    return settings, state, jax.jit(spec_step, static_argnums=3)


def test_spec_step_commits_a_whole_accepted_path(target, reference):
    ar, ref = reference
    settings, s, step = _state(target, ref, ChainOracle())
    after = step(target, ref, s, settings)
    np.testing.assert_array_equal(after.accept_lengths[:, 0], [5, 5, 5])
    np.testing.assert_array_equal(after.tokens[:, :6], np.asarray(ar.tokens)[:, :6])
    np.testing.assert_array_equal(after.tokens[:, 6:], -1)
    np.testing.assert_array_equal(after.num_tokens, [6, 6, 6])
    np.testing.assert_array_equal(after.cache.lengths, s.cache.lengths + 5)
    np.testing.assert_array_equal(after.drafted[:, :6], [[False] + [True] * 4 + [False]] * 3)
    np.testing.assert_array_equal(after.root, np.asarray(ar.tokens)[:, 5])
    # The compacted cache equals the AR cache: one more step from here is still exact.
    again = step(target, ref, after, settings)
    np.testing.assert_array_equal(again.tokens[:, :11], np.asarray(ar.tokens)[:, :11])


def test_spec_step_with_every_draft_rejected_emits_the_bonus_token_only(target, reference):
    ar, ref = reference
    settings, s, step = _state(target, ref, ChainOracle(wrong=1))
    after = step(target, ref, s, settings)
    np.testing.assert_array_equal(after.accept_lengths[:, 0], [1, 1, 1])
    np.testing.assert_array_equal(after.tokens[:, :2], np.asarray(ar.tokens)[:, :2])
    np.testing.assert_array_equal(after.cache.lengths, s.cache.lengths + 1)
    assert not np.asarray(after.drafted).any()
    np.testing.assert_array_equal(after.node_tries.reshape(3, 4, 1)[:, :, 0], [[1, 0, 0, 0]] * 3)
    np.testing.assert_array_equal(after.node_hits, 0)


def test_spec_step_stops_a_row_at_an_eos_inside_the_accepted_path(target, reference):
    ar, ref = reference
    generated = np.asarray(ar.tokens)
    # A token that first appears mid-path (tokens 1..5 are the first step's path and bonus) in some row.
    row, index = next((r, i) for r in range(3) for i in (2, 3, 4) if generated[r, i] not in generated[r, :i])
    eos = int(generated[row, index])
    settings, s, step = _state(target, ref, ChainOracle(), eos_ids=(eos,))
    assert not bool(s.done[row])
    after = step(target, ref, s, settings)
    assert bool(after.done[row]) and int(after.num_tokens[row]) == index + 1
    np.testing.assert_array_equal(after.tokens[row, : index + 1], generated[row, : index + 1])
    np.testing.assert_array_equal(after.tokens[row, index + 1:], -1)
    for r in range(3):
        hit = [i for i in range(6) if generated[r, i] == eos]
        assert bool(after.done[r]) == bool(hit)
        assert int(after.num_tokens[r]) == (hit[0] + 1 if hit else 6)


def test_spec_step_leaves_a_done_row_alone(target, reference):
    _, ref = reference
    settings, s, step = _state(target, ref, ChainOracle())
    s = s.replace(done=jnp.asarray([False, True, False]))
    after = step(target, ref, s, settings)
    np.testing.assert_array_equal(after.tokens[1], s.tokens[1])
    assert int(after.num_tokens[1]) == 1 and int(after.accept_lengths[1, 0]) == 0
    assert int(after.cache.lengths[1]) == int(s.cache.lengths[1])
    assert int(after.node_tries[1].sum()) == 0
    np.testing.assert_array_equal(np.asarray(after.num_tokens)[[0, 2]], [6, 6])
    # the step counter is shared; AR-equality of the live rows is the lossless tests' business
    assert int(after.steps) == 1


# Verification on per-row trees: distributions ---------------------------------------------------------------

VOCAB = 5


def _warped_tables(seed: int, sampling: SamplingConfig) -> list[np.ndarray]:
    """A synthetic target over a 5-token vocabulary: its logits after the prefix (t1, ..., tk) are
    `tables[k][t1, ..., tk]` (k = 0..3), sharp enough that drafts are accepted and rejected alike. Returns
    (logit tables, warped probability tables)."""
    rng = np.random.RandomState(seed)
    logits = [rng.normal(size=(VOCAB,) * k + (VOCAB,)).astype(np.float32) * 2.0 for k in range(4)]
    probs = [np.asarray(jax.nn.softmax(warp_logits(jnp.asarray(t), sampling), -1), np.float64) for t in logits]
    return logits, [p / p.sum(-1, keepdims=True) for p in probs]


def _node_logits(tables: list[np.ndarray], tokens: np.ndarray, tree) -> np.ndarray:
    """`[B, N, V]` the target's logits after each node's path of draft tokens (the root: the empty prefix)."""
    mask, depth = np.asarray(tree.mask), np.asarray(tree.depth)
    at = mask[:, :, None, :] & (depth[:, None, None, :] == np.arange(1, 4)[None, None, :, None])  # [B, N, 3, N]
    anc = np.take_along_axis(tokens[:, None, None, :].repeat(mask.shape[1], 1), at.argmax(-1)[..., None], -1)[..., 0]
    out = np.empty(tokens.shape + (VOCAB,), np.float32)
    for k in range(4):
        sel = depth == k
        out[sel] = tables[k][tuple(anc[sel][:, j] for j in range(k))]
    return out


@pytest.mark.parametrize("draft", ["point-mass", "iid-q"])
@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, top_k=3, top_p=0.9)],
                         ids=["t1", "top-k-top-p"])
@default_cases('top-k-top-p-point-mass')
def test_joint_of_the_first_three_tokens_on_random_per_row_trees(draft, sampling):
    """One verification per row, every row its own random tree (depth <= 3) of random drafts, then exact
    sampling of the tokens the step did not commit: the joint of the first three tokens must be the
    target's, and so must the token after a depth-1 node accepted once an earlier sibling holding another
    token was rejected. The iid-q cases run under -m slow: test_speculative.py's
    test_rejection_sampling_with_iid_draft_distribution_q (siblings sharing q, chi-square) and
    test_rejection_walk_equals_a_plain_python_walk[iid-q] (the residual walk on a 63-node tree) cover that path."""
    rows, budget = 60000, TreeBudget(num_nodes=10, depth=3, num_paths=9, max_children=9, num_ranks=9)
    tables, probs = _warped_tables(0, sampling)
    keys = jax.random.split(jax.random.key(1), 4)
    parent, valid = random_parents(keys[0], rows, budget)
    tree = arrays_from_parents(parent, valid, depth=3, num_paths=9, max_children=9, num_ranks=9)
    if draft == "point-mass":
        tokens, q = jax.random.randint(keys[2], (rows, budget.num_nodes), 0, VOCAB), None
    else:  # siblings are i.i.d. draws from their depth's q
        q = jax.nn.softmax(jax.random.normal(keys[1], (4, VOCAB)) * 1.5, -1)[tree.depth]  # [B, N, V]
        tokens = jax.random.categorical(keys[2], jnp.log(q))
    tokens = np.asarray(tokens.at[:, 0].set(0), np.int32)  # the root's own token plays no part
    verdict = jax.jit(lambda t, lg, tr, q, k: verify_rejection(t, lg, tr, sampling, k, q))(
        jnp.asarray(tokens), jnp.asarray(_node_logits(tables, tokens, tree)), tree, q, keys[3])
    nodes, count, bonus = (np.asarray(x) for x in (verdict.accepted_nodes, verdict.n_accepted, verdict.bonus))
    # Committed tokens (the path's drafts, then the bonus), completed to three by exact sampling.
    committed = np.where(np.arange(4)[None] < count[:, None] - 1,
                         np.take_along_axis(tokens, np.roll(np.maximum(nodes, 0), -1, 1), 1), bonus[:, None])
    rng = np.random.RandomState(2)
    seqs = committed[:, :3].copy()
    for k in (1, 2):
        short = count < k + 1  # the step committed k tokens or fewer: token k + 1 is sampled exactly
        for b in np.flatnonzero(short):
            seqs[b, k] = rng.choice(VOCAB, p=probs[k][tuple(seqs[b, :k])])
    joint = (probs[0][:, None, None] * probs[1][:, :, None] * probs[2]).reshape(-1)
    counts = np.bincount(seqs[:, 0] * VOCAB * VOCAB + seqs[:, 1] * VOCAB + seqs[:, 2], minlength=VOCAB ** 3)
    assert chi_square(counts, joint) < chi2_999(int((joint > 0).sum()) - 1)
    # The token after a depth-1 node accepted once an earlier sibling with another token was rejected.
    rank, first = np.asarray(tree.rank), np.maximum(nodes[:, 1], 0)
    earlier = (np.asarray(tree.parent) == 0) & np.asarray(tree.valid) & (np.arange(budget.num_nodes) > 0) & (
        rank < rank[np.arange(rows), first][:, None]) & (tokens != tokens[np.arange(rows), first][:, None])
    after_rejection = (count >= 2) & earlier.any(1)
    assert after_rejection.sum() > 2000
    for t1 in range(VOCAB):
        sel = after_rejection & (seqs[:, 0] == t1)
        if sel.sum() >= 200:
            assert chi_square(np.bincount(seqs[sel, 1], minlength=VOCAB), probs[1][t1]) < chi2_999(VOCAB - 1)


# Verify-time extras -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CopyExtras(ChainOracle):
    """A chain oracle whose proposal adds one extra query per tree node: the node's own token embedding at the
    node's position, seeing the node's strict ancestors and itself (so its hidden state must equal the node's),
    plus, with `prefix > 0`, random per-layer prefix keys/values. Its prefill adds two extras that see the
    whole prompt. `commit` and `prefill` keep the extras' hidden states in the state."""

    prefix: int = 0

    def init_state(self, target_config, batch, cache_size):
        return {"verify": jnp.zeros((batch, 5, target_config.hidden_size)),
                "prefill": jnp.zeros((batch, 2, target_config.hidden_size))}

    def _prefix(self, target, batch):
        c = target.config
        shape = (c.num_layers, batch, self.prefix, c.num_kv_heads, c.head_dim)
        k1, k2 = jax.random.split(jax.random.key(5))
        return jax.random.normal(k1, shape), jax.random.normal(k2, shape)

    def num_extras(self, tree):
        return tree.num_nodes

    def prefill_extras(self, params, target, prompt, lengths):
        b, t = prompt.shape
        return Extras(target.embed(jnp.stack([prompt[:, 0], prompt[:, 1]], 1)), lengths[:, None] + jnp.arange(2),
                      jnp.broadcast_to(jnp.arange(t)[None, None] < lengths[:, None, None], (b, 2, t)),
                      jnp.broadcast_to(jnp.tril(jnp.ones((2, 2), bool)), (b, 2, 2)))

    def prefill(self, params, target, prompt, state):
        return state | {"prefill": prompt.out.hidden[:, -2:]}

    def propose(self, params, target, ctx, tree, rng):
        proposal = super().propose(params, target, ctx, tree, rng)
        b, n = proposal.tokens.shape
        pk, pv = self._prefix(target, b) if self.prefix else (None, None)
        eye = jnp.broadcast_to(jnp.eye(n, dtype=bool), (b, n, n))
        extras = Extras(target.embed(proposal.tokens), ctx.lengths[:, None] + proposal.tree.depth,
                        proposal.tree.mask & ~eye, eye, pk, pv)
        return proposal.replace(extras=extras)

    def commit(self, params, target, proposal, verdict, verify_out, state):
        n = proposal.tokens.shape[1]
        assert verify_out.hidden.shape[1] == n + proposal.extras.count
        return state | {"verify": verify_out.hidden[:, n:]}, accepted_hidden(verdict, verify_out)


@pytest.mark.parametrize("prefix", [0, 3])
@pytest.mark.parametrize("wrong", [0, 1])
@default_cases('0-0', '1-3')
def test_extras_change_nothing_the_target_commits(target, reference, prefix, wrong):
    """The two default cases take both prefix paths (none, prefix keys/values) and both ends of acceptance (every
    draft taken, every draft rejected); the other two combinations add no code path and run under -m slow."""
    ar, ref = reference
    tokens, lengths = pad_prompts(PROMPTS)
    out = speculative_generate(target, ref, tokens, lengths, jax.random.key(0), config=CONFIG,
                               drafter=CopyExtras(wrong=wrong, prefix=prefix), tree=chain(4), max_new_tokens=NEW,
                               cache_size=96)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ar.tokens))
    assert int(out.steps) == (-(-(NEW - 1) // 5) if wrong == 0 else NEW - 1)


@dataclasses.dataclass(frozen=True)
class UndeclaredExtras(CopyExtras):
    """Proposes extras but says it adds none."""

    def num_extras(self, tree):
        return 0


def test_the_cache_is_sized_with_the_drafters_extras(target, reference):
    _, ref = reference
    tokens, lengths = pad_prompts(PROMPTS)
    tree = chain(4)
    assert scratch_slots(CopyExtras(), tree) == 2 * tree.num_nodes
    assert scratch_slots(ChainOracle(), tree) == tree.num_nodes
    need = tokens.shape[1] + NEW + scratch_slots(CopyExtras(), tree)
    run = functools.partial(speculative_generate, target, ref, tokens, lengths, jax.random.key(0), config=CONFIG,
                            tree=tree, max_new_tokens=NEW)
    assert int(run(drafter=CopyExtras(), cache_size=need).num_tokens.min()) == NEW  # an exact fit decodes
    with pytest.raises(PromptTooLongError, match="scratch slots"):
        run(drafter=CopyExtras(), cache_size=need - 1)
    with pytest.raises(ValueError, match="num_extras"):
        run(drafter=UndeclaredExtras(), cache_size=need)


def _direct(target, tokens, positions, mask, embeds, prefix_kv):
    """An uncached forward of one row over `tokens` then `embeds` with an explicit full visibility mask."""
    t = tokens.shape[1]
    prefix = None
    if prefix_kv is not None:
        rows = (jnp.arange(mask.shape[1]) >= t)[None, :, None]  # only the extras see the prefix
        visible = jnp.broadcast_to(rows, mask.shape[:2] + (prefix_kv[0].shape[2],))
        prefix = PrefixKV(prefix_kv[0], prefix_kv[1], visible)
    return Transformer(CONFIG).apply({"params": target}, tokens, positions, None, mask, False, embeds, prefix).hidden


@pytest.mark.parametrize("prefix", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_extras_hidden_states_reach_commit_equal_to_a_direct_forward(target, reference, prefix):
    _, ref = reference
    drafter = CopyExtras(wrong=1, prefix=prefix)
    settings = DecodeSpec(CONFIG, drafter, chain(4), NEW)
    tokens, lengths = pad_prompts(PROMPTS)
    s = spec_init(target, ref, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0), 96, settings)
    ctx = DraftContext(s.hidden, s.root, s.cache.lengths, s.draft_state)
    proposal = drafter.propose(ref, Target(CONFIG, target), ctx, settings.tree, jax.random.key(0))
    after = jax.jit(spec_step, static_argnums=3)(target, ref, s, settings)
    n = settings.tree.num_nodes
    for b, length in enumerate(lengths.tolist()):
        e = proposal.extras
        full = length + n + n
        mask = np.zeros((full, full), bool)
        mask[:length, :length] = np.tril(np.ones((length, length), bool))
        mask[length:, :length] = True  # tree nodes and extras see the committed prompt
        mask[length: length + n, length: length + n] = np.asarray(proposal.tree.mask[b])
        mask[length + n:, length: length + n] = np.asarray(e.sees_new[b])
        mask[length + n:, length + n:] = np.asarray(e.sees_extras[b])
        positions = jnp.concatenate([jnp.arange(length), length + proposal.tree.depth[b], e.positions[b]])[None]
        row_tokens = jnp.concatenate([jnp.asarray(tokens[b, :length]), proposal.tokens[b]])[None]
        prefix_kv = None if e.prefix_k is None else (e.prefix_k[:, b: b + 1], e.prefix_v[:, b: b + 1])
        want = _direct(target, row_tokens, positions, jnp.asarray(mask)[None], e.embeds[b: b + 1], prefix_kv)
        np.testing.assert_allclose(np.asarray(after.draft_state["verify"][b]), np.asarray(want[0, length + n:]),
                                   atol=2e-5)
        if not prefix:  # each extra copies its node: same input, position and visibility
            inner = jnp.asarray(mask)[None, : length + n, : length + n]
            nodes = _direct(target, row_tokens, positions[:, : length + n], inner, None, None)
            np.testing.assert_allclose(np.asarray(after.draft_state["verify"][b]), np.asarray(nodes[0, length:]),
                                       atol=2e-5)
    # The prefill's two extras saw the whole prompt: a direct forward of prompt + extras agrees.
    for b, length in enumerate(lengths.tolist()):
        mask = np.tril(np.ones((length + 2, length + 2), bool))
        positions = jnp.arange(length + 2)[None]
        embeds = Target(CONFIG, target).embed(jnp.asarray(tokens[b: b + 1, :2]))
        want = _direct(target, jnp.asarray(tokens[b: b + 1, :length]), positions, jnp.asarray(mask)[None], embeds,
                       None)
        np.testing.assert_allclose(np.asarray(s.draft_state["prefill"][b]), np.asarray(want[0, length:]), atol=2e-5)
