"""The speculative engine: lossless greedy decoding, an oracle drafter, lossless sampling, one compile."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.drafters import Amphista, BiTA, DFlash, Eagle, Eagle3, Gumiho, Hydra, Medusa, SemiAutoregressive
from amphista_jax.drafters.base import DraftContext, Proposal
from amphista_jax.drafters.draft_model import DraftModel
from amphista_jax.engine.decode import generate, pad_prompts, speculative_generate
from amphista_jax.engine.decode_spec import scratch_slots
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import Transformer, init_params
from amphista_jax.models.target import Target
from amphista_jax.trees.growth import dynamic_tree
from amphista_jax.trees.names import PRESETS
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.tree import TreeSpec, batched, children, tree_arrays
from amphista_jax.trees.verify import verify_rejection
from tests.helpers import (
    CHI2_999,
    CONFIG,
    PROMPTS,
    ReferenceOracle,
    assert_compiles_once,
    chi_square,
    default_cases,
    reference_rows,
)

NEW = 40


@dataclasses.dataclass(frozen=True)
class Oracle(ReferenceOracle):
    """Proposes the target's own greedy continuation at every node (`params` = the full reference rows)."""

    def propose(self, params, target, ctx: DraftContext, tree, rng):
        arrays = batched(tree_arrays(tree), ctx.root.shape[0])
        pos = ctx.lengths[:, None] + arrays.depth  # [B, N] position of each node's token
        tokens = jnp.take_along_axis(params, jnp.minimum(pos, params.shape[1] - 1), axis=1)
        return Proposal(tokens.at[:, 0].set(ctx.root), arrays)


@dataclasses.dataclass(frozen=True)
class NoisyOracle(Oracle):
    """The oracle's tokens, each node corrupted with probability `p`: paths are accepted partway, and often
    through a sibling that is not the first-ranked one."""

    p: float = 0.35

    def propose(self, params, target, ctx: DraftContext, tree, rng):
        good = super().propose(params, target, ctx, tree, rng)
        corrupt = jax.random.bernoulli(rng, self.p, good.tokens.shape).at[:, 0].set(False)
        return good.replace(tokens=jnp.where(corrupt, (good.tokens + 1) % CONFIG.vocab_size, good.tokens))


@pytest.fixture(scope="module")
def target():
    return init_params(CONFIG, jax.random.key(0))


@pytest.fixture(scope="module")
def medusa_heads(target):
    medusa = Medusa(num_heads=4, num_layers=1)
    params = medusa.init(jax.random.key(1), Target(CONFIG, target))
    noise = jax.random.normal(jax.random.key(2), params["w"].shape) * 0.3
    return medusa, params | {"w": noise}


def _run(target, drafter, dparams, prompts, tree, **kw):
    tokens, lengths = pad_prompts(prompts)
    kw = dict(config=CONFIG, drafter=drafter, tree=tree, max_new_tokens=NEW, cache_size=128) | kw
    return speculative_generate(target, dparams, tokens, lengths, jax.random.key(0), **kw)


def _ar(target, prompts):
    tokens, lengths = pad_prompts(prompts)
    return generate(target, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=NEW, cache_size=64)


@pytest.mark.parametrize("tree", sorted(PRESETS))
@pytest.mark.parametrize("batch", [1, 3])
@default_cases('3-chain-1', '3-mc_sim_7b_63')
def test_greedy_medusa_equals_ar(target, medusa_heads, tree, batch):
    """Batch 1 and the other presets add no code path to these two cases (a tree shallower than the heads, which
    projects only its own, and the widest, deepest tree, both over ragged rows): they run under -m slow."""
    prompts = PROMPTS[:batch] if batch == 3 else PROMPTS[1:2]
    ar = _ar(target, prompts)
    spec = _run(target, *medusa_heads, prompts, PRESETS[tree])
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(spec.num_tokens), np.asarray(ar.num_tokens))
    lengths = np.asarray(spec.accept_lengths)
    assert (lengths.sum(1) == NEW - 1).all()  # the prefill made the first token


@pytest.mark.parametrize("tree", sorted(PRESETS))
@default_cases('mc_sim_7b_63')
def test_oracle_drafter_accepts_whole_depth_every_step(target, tree):
    """The presets differ only in shape, not in code path: the widest and deepest (mc_sim_7b_63) is the default
    case, the others run under -m slow."""
    ar = _ar(target, PROMPTS)
    tokens, lengths = pad_prompts(PROMPTS)
    ref = np.zeros((3, tokens.shape[1] + NEW + 8), np.int32)
    for row, prompt in enumerate(PROMPTS):
        ref[row, : len(prompt)] = prompt
        ref[row, len(prompt): len(prompt) + NEW] = np.asarray(ar.tokens[row])
    spec = _run(target, Oracle(), jnp.asarray(ref), PROMPTS, PRESETS[tree])
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    assert reference_rows(ar, PROMPTS, ref.shape[1]).tolist() == ref.tolist()
    depth = PRESETS[tree].depth
    steps = int(spec.steps)
    full = (NEW - 1) // (depth + 1)
    accepted = np.asarray(spec.accept_lengths)[:, :steps]
    assert (accepted[:, :full] == depth + 1).all()  # every step but the one cut by max_new_tokens
    assert steps == -(-(NEW - 1) // (depth + 1))


@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "small-16"])
@pytest.mark.parametrize("windows", [(0, 0), (5, 0)])
@pytest.mark.slow
@default_cases('windows1-mc_sim_7b_63')
def test_partial_paths_through_later_siblings_stay_lossless(tree, windows):
    """Accepted paths that stop partway and run through non-first siblings, with and without a sliding
    window: still exactly the AR output, and the drafted tokens really are used. Under -m slow:
    test_pallas_tree_attention_in_the_decode_loop_stays_lossless[windows1] decodes the same noisy oracle's partial
    paths with a sliding window losslessly, and test_engine.py's
    test_random_per_row_trees_decode_losslessly_and_compile_once asserts partial paths of several lengths on the XLA
    attention path."""
    config = tiny_llama_config(sliding_windows=windows)
    params = init_params(config, jax.random.key(0))
    tokens, lengths = pad_prompts(PROMPTS)
    ar = generate(params, tokens, lengths, jax.random.key(0), config=config, max_new_tokens=NEW, cache_size=64)
    ref = reference_rows(ar, PROMPTS, tokens.shape[1] + NEW + 8)
    spec = speculative_generate(params, ref, tokens, lengths, jax.random.key(0), config=config, drafter=NoisyOracle(),
                                tree=PRESETS[tree], max_new_tokens=NEW, cache_size=128)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    accepted = np.asarray(spec.accept_lengths)[:, : int(spec.steps)]
    assert np.asarray(spec.drafted).sum() > 30
    assert len(set(accepted[accepted > 0].tolist())) >= 3  # a spread of partial accept lengths


@pytest.mark.parametrize("windows", [(0, 0), (4, 0)])
@default_cases('windows1')
def test_pallas_tree_attention_in_the_decode_loop_stays_lossless(windows):
    """The same generation with the Pallas kernel (interpret mode on CPU) in every cached forward."""
    config = tiny_llama_config(sliding_windows=windows)
    params = init_params(config, jax.random.key(0))
    tokens, lengths = pad_prompts(PROMPTS)
    ar = generate(params, tokens, lengths, jax.random.key(0), config=config, max_new_tokens=16, cache_size=48)
    ar_kernel = generate(params, tokens, lengths, jax.random.key(0), config=config, max_new_tokens=16, cache_size=48,
                         attention="pallas")
    np.testing.assert_array_equal(np.asarray(ar_kernel.tokens), np.asarray(ar.tokens))
    ref = reference_rows(ar, PROMPTS, tokens.shape[1] + NEW + 8)
    spec = speculative_generate(params, ref, tokens, lengths, jax.random.key(0), config=config, drafter=NoisyOracle(),
                                tree=PRESETS["small-8"], max_new_tokens=16, cache_size=48, attention="pallas")
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    assert np.asarray(spec.drafted).sum() > 0


@pytest.mark.slow
def test_eos_stops_rows_inside_an_accepted_path(target):
    """Under -m slow: test_engine.py's test_spec_step_stops_a_row_at_an_eos_inside_the_accepted_path stops a row at
    an EOS inside an accepted path and pads after it, and test_spec_step_leaves_a_done_row_alone keeps it stopped."""
    ar = _ar(target, PROMPTS)
    eos = int(np.asarray(ar.tokens)[0, 7])
    tokens, lengths = pad_prompts(PROMPTS)
    ref = np.zeros((3, tokens.shape[1] + NEW + 8), np.int32)
    for row, prompt in enumerate(PROMPTS):
        ref[row, : len(prompt)] = prompt
        ref[row, len(prompt): len(prompt) + NEW] = np.asarray(ar.tokens[row])
    spec = _run(target, Oracle(), jnp.asarray(ref), PROMPTS, PRESETS["chain-4"], eos_ids=(eos,), pad_id=-1)
    plain = generate(target, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=NEW, cache_size=64,
                     eos_ids=(eos,), pad_id=-1)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(spec.num_tokens), np.asarray(plain.num_tokens))


def test_medusa_refuses_a_tree_deeper_than_its_heads(target):
    medusa = Medusa(num_heads=2)
    with pytest.raises(ValueError, match="tree depth 4 needs 4 heads"):
        _run(target, medusa, medusa.init(jax.random.key(0), Target(CONFIG, target)), PROMPTS, PRESETS["chain-4"])


def test_speculative_generation_compiles_once(target, medusa_heads):
    assert_compiles_once(target, medusa_heads[0], medusa_heads[1], PRESETS["small-8"], max_new_tokens=NEW)


@pytest.mark.parametrize("proposal", ["good", "poor"])
def test_tree_rejection_sampling_keeps_the_target_distribution(proposal):
    """Root with three children (top-k drafts) each with a child: the first committed token must follow the
    target's distribution at the root, and the second its distribution at the first token."""
    vocab = 8
    spec = TreeSpec(((0,), (1,), (2,), (0, 0), (1, 0), (2, 0)))
    arrays = batched(tree_arrays(spec), 1)
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.normal(size=(1, spec.num_nodes, vocab)) * 1.5, jnp.float32)
    probs = np.asarray(jax.nn.softmax(logits[0], -1))
    order = np.argsort(-probs[0]) if proposal == "good" else np.argsort(probs[0])  # poor: least likely first
    tokens = np.zeros((1, spec.num_nodes), np.int32)
    tokens[0, 1:4] = order[:3]
    tokens[0, 4:7] = [np.argmax(probs[i]) if proposal == "good" else np.argmin(probs[i]) for i in (1, 2, 3)]
    n = 20000
    keys = jax.random.split(jax.random.key(42), n)
    run = jax.jit(jax.vmap(lambda k: verify_rejection(jnp.asarray(tokens), logits, arrays, SamplingConfig(1.0), k)))
    verdict = run(keys)
    nodes, count, bonus = (np.asarray(x)[:, 0] for x in (verdict.accepted_nodes, verdict.n_accepted, verdict.bonus))
    first = np.where(count >= 2, tokens[0, np.maximum(nodes[:, 1], 0)], bonus)
    assert chi_square(np.bincount(first, minlength=vocab), probs[0]) < CHI2_999[7]
    # Second token given that the first was the tree's top candidate (node 1).
    took_1 = (count >= 2) & (nodes[:, 1] == 1)
    second = np.where(count[took_1] >= 3, tokens[0, np.maximum(nodes[took_1, 2], 0)], bonus[took_1])
    assert chi_square(np.bincount(second, minlength=vocab), probs[1]) < CHI2_999[7]


def _reference_walk(tokens, probs, q, kids, key, depth):
    """Plain numpy, one row: from the root, try each node's children in rank order with the draw
    `uniform(fold_in(key, d * C + c))`; accept the first with `u < p(x) / q(x)` (q = None: a point mass on x);
    after a rejection the target becomes the residual. Returns (path, count, final distribution)."""
    width = kids.shape[1]
    cur, p, path = 0, probs[0], [0]
    for d in range(depth):
        chosen = -1
        for c in range(width):
            child = kids[cur, c]
            if child < 0:
                break
            x = tokens[child]
            u = float(jax.random.uniform(jax.random.fold_in(key, d * width + c)))
            qx = 1.0 if q is None else q[child][x]
            if u < p[x] / max(qx, 1e-20):
                chosen = child
                break
            if q is None:
                p = np.where(np.arange(p.size) == x, 0.0, p) / max(1.0 - p[x], 1e-20)
            else:
                p = np.maximum(p - q[child], 0.0)
                p = p / max(p.sum(), 1e-20)
        if chosen < 0:
            break
        cur, p = chosen, probs[chosen]
        path.append(chosen)
    return path, len(path), p


@pytest.mark.parametrize("draft", ["point-mass", "iid-q"])
def test_rejection_walk_equals_a_plain_python_walk(draft):
    """Per row, the accepted path and its length equal a plain numpy walk with the same draws (63-node tree,
    batch 4, sharp targets so paths get deep), and the bonus lies in the final distribution's support."""
    b, vocab = 4, 32
    spec = PRESETS["mc_sim_7b_63"]
    arrays = batched(tree_arrays(spec), b)
    n = spec.num_nodes
    kids = np.asarray(children(arrays))
    run = jax.jit(lambda t, lg, k, q: verify_rejection(t, lg, arrays, SamplingConfig(1.0), k, q))
    deepest = 0
    for seed in range(12):
        rng = np.random.RandomState(seed)
        tokens = rng.randint(0, 3, size=(b, n)).astype(np.int32)
        logits = rng.normal(size=(b, n, vocab)).astype(np.float32)
        logits[:, :, :3] += 4.0  # most of the mass on the drafted tokens
        q = None if draft == "point-mass" else np.asarray(
            jax.nn.softmax(jnp.asarray(rng.normal(size=(b, n, vocab)), jnp.float32) * 2, -1))
        key = jax.random.key(seed)
        v = run(jnp.asarray(tokens), jnp.asarray(logits), key, None if q is None else jnp.asarray(q))
        probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), -1), np.float64)
        for row, row_key in enumerate(jax.random.split(key, b)):
            path, count, final = _reference_walk(tokens[row], probs[row], None if q is None else q[row], kids[row],
                                                 row_key, arrays.max_depth)
            assert int(v.n_accepted[row]) == count
            np.testing.assert_array_equal(np.asarray(v.accepted_nodes[row]), path + [-1] * (spec.depth + 1 - count))
            assert final[int(v.bonus[row])] > 0
            deepest = max(deepest, count)
    assert deepest >= 3  # the walk went past depth 1 and tried later siblings


def test_rejection_sampling_with_iid_draft_distribution_q():
    """Drafts drawn i.i.d. from a draft distribution q (siblings share q): the first committed token still
    follows the target's root distribution."""
    vocab = 8
    spec = TreeSpec(((0,), (1,), (2,)))
    arrays = batched(tree_arrays(spec), 1)
    rng = np.random.RandomState(1)
    logits = jnp.asarray(rng.normal(size=(1, spec.num_nodes, vocab)) * 1.5, jnp.float32)
    probs = np.asarray(jax.nn.softmax(logits[0], -1))
    q_root = np.asarray(jax.nn.softmax(jnp.asarray(rng.normal(size=vocab) * 2.0)))  # a mediocre drafter
    n = 20000

    def one(key):
        draws = jax.random.categorical(jax.random.fold_in(key, 1), jnp.log(jnp.asarray(q_root)), shape=(3,))
        tokens = jnp.concatenate([jnp.zeros((1,), jnp.int32), draws.astype(jnp.int32)])[None]
        q = jnp.broadcast_to(jnp.asarray(q_root), (1, spec.num_nodes, vocab))
        v = verify_rejection(tokens, logits, arrays, SamplingConfig(1.0), jax.random.fold_in(key, 2), q)
        return jnp.where(v.n_accepted[0] >= 2, tokens[0, jnp.maximum(v.accepted_nodes[0, 1], 0)], v.bonus[0])

    first = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(3), n)))
    assert chi_square(np.bincount(first, minlength=vocab), probs[0]) < CHI2_999[7]


@pytest.mark.parametrize(("drafter", "tree"), [
    # Amphista's, Hydra++'s, SAR's and the top-k draft model's proposals take the same q = None path as Medusa's
    # and Hydra's: in the slow run.
    (Medusa(num_heads=3), PRESETS["small-8"]),
    pytest.param(Amphista(num_heads=3), PRESETS["small-8"], marks=pytest.mark.slow),
    (Hydra(num_heads=3), PRESETS["small-8"]),
    pytest.param(Hydra.plus_plus(num_heads=3), PRESETS["small-8"], marks=pytest.mark.slow),
    (Eagle(), dynamic_tree(8, 3, 3)), (Eagle3(), dynamic_tree(8, 3, 3)),
    (Gumiho(top_k=2, fta_nodes=2), dynamic_tree(8, 4, 3)),
    pytest.param(SemiAutoregressive(num_heads=3), PRESETS["small-8"], marks=pytest.mark.slow),
    pytest.param(DraftModel(tiny_llama_config(vocab_size=16, num_layers=1, hidden_size=32)), PRESETS["small-8"],
                 marks=pytest.mark.slow),
    (DraftModel(tiny_llama_config(vocab_size=16, num_layers=1, hidden_size=32), temperature=1.0), PRESETS["small-8"]),
    # made from the target's first layer, its draws over 9 of the 16 tokens (q zero on the other 7)
    (DraftModel(layers=1, draft_vocab=(0, 2, 3, 5, 7, 8, 11, 13, 15), temperature=1.0), PRESETS["small-8"]),
    # drafting stopped below unsure nodes (p_min): here about 40% of the root's children and 70% deeper not drafted
    (DraftModel(layers=1, temperature=1.0, p_min=0.3), PRESETS["small-8"]),
    (BiTA(), PRESETS["small-8"]),
    # one distribution per depth, every node an independent draw from its depth's (base.sampled_proposal)
    (DFlash(block_size=4, num_layers=1, temperature=1.0), PRESETS["small-8"])],
    ids=["medusa", "amphista", "hydra", "hydra++", "eagle-2", "eagle-3", "gumiho", "sar", "draft-model",
         "draft-model-iid-q", "made-draft-model-draft-vocab-iid-q", "draft-model-p-min-iid-q", "bita", "dflash-iid-q"])
@default_cases('eagle-2', 'draft-model-iid-q', 'draft-model-p-min-iid-q', 'dflash-iid-q')
def test_speculative_sampling_matches_the_target_end_to_end(drafter, tree):
    """Many rows of one prompt, temperature 1 on a 16-token vocabulary: the second generated token's
    marginal equals the exact one computed from the target. One default case per acceptance path: q = None on
    per-row trees (EAGLE-2; Medusa's and BiTA's static trees take the same path, checked on a static tree by
    test_tree_rejection_sampling_keeps_the_target_distribution), i.i.d. draws from q (the draft model), and those
    draws on a static tree cut where the draft is unsure (p_min); the other cases run under -m slow."""
    config = tiny_llama_config(vocab_size=16)
    params = init_params(config, jax.random.key(5))
    params = jax.tree.map(lambda x: x * 8 if x.ndim >= 2 else x, params)  # sharper distributions
    heads = drafter.init(jax.random.key(6), Target(config, params))
    prompt = [3, 7, 1]
    rows = 4000
    tokens, lengths = pad_prompts([prompt] * rows, length=4)
    out = speculative_generate(params, heads, tokens, lengths, jax.random.key(9), config=config, drafter=drafter,
                               tree=tree, max_new_tokens=3, cache_size=max(16, 4 + 3 + scratch_slots(drafter, tree)),
                               sampling=SamplingConfig(temperature=1.0))
    second = np.asarray(out.tokens[:, 1])
    model = Transformer(config)
    first_logits = model.apply({"params": params}, jnp.asarray([prompt]), jnp.arange(3)[None]).logits[0, -1]
    seqs = jnp.asarray([prompt + [t] for t in range(16)])
    cond_logits = model.apply({"params": params}, seqs, jnp.broadcast_to(jnp.arange(4), (16, 4))).logits[:, -1]
    first_dist, cond = jax.nn.softmax(first_logits), jax.nn.softmax(cond_logits)
    exact = np.asarray(first_dist @ cond)
    assert chi_square(np.bincount(second, minlength=16), exact / exact.sum()) < CHI2_999[15]


def test_tree_statistics_count_tried_and_accepted_nodes_by_depth_and_rank(target):
    """The oracle proposes the right token at every node, so greedy acceptance takes the all-rank-0 path
    (the first longest one) each step: every node whose parent lies on that path is tried once per step, and
    only the rank-0 child is hit. Expected counts come from the tree spec alone."""
    tree = PRESETS["mc_sim_7b_63"]
    ar = _ar(target, PROMPTS)
    tokens, _ = pad_prompts(PROMPTS)
    spec = _run(target, Oracle(), reference_rows(ar, PROMPTS, tokens.shape[1] + NEW + 8), PROMPTS, tree)
    steps = (np.asarray(spec.accept_lengths) > 0).sum(1)  # [B] each row's decoding forwards
    tries, hits = np.asarray(spec.node_tries), np.asarray(spec.node_hits)  # [B, D, R]
    ranks = tries.shape[2]
    assert tries.shape == (3, tree.depth, max(p[-1] for p in tree.choices) + 1)
    for d in range(tree.depth):
        for r in range(ranks):
            under_accepted = ((0,) * d + (r,)) in tree.choices
            np.testing.assert_array_equal(tries[:, d, r], steps * under_accepted)
            np.testing.assert_array_equal(hits[:, d, r], steps * (under_accepted and r == 0))
    assert generate(target, tokens, pad_prompts(PROMPTS)[1], jax.random.key(0), config=CONFIG, max_new_tokens=4,
                    cache_size=64).node_tries is None  # AR has no tree


def test_tree_statistics_with_partial_acceptance():
    """Noisy drafts: every depth-1 node is tried once per step, and the hits add up to the accepted drafts."""
    params = init_params(CONFIG, jax.random.key(0))
    tokens, lengths = pad_prompts(PROMPTS)
    ar = generate(params, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=NEW, cache_size=64)
    ref = reference_rows(ar, PROMPTS, tokens.shape[1] + NEW + 8)
    tree = PRESETS["small-16"]
    spec = speculative_generate(params, ref, tokens, lengths, jax.random.key(0), config=CONFIG, drafter=NoisyOracle(),
                                tree=tree, max_new_tokens=NEW, cache_size=128)
    accepted = np.asarray(spec.accept_lengths)
    steps = (accepted > 0).sum(1)
    tries, hits = np.asarray(spec.node_tries), np.asarray(spec.node_hits)
    depth1 = [p[0] for p in tree.choices if len(p) == 1]
    np.testing.assert_array_equal(tries[:, 0, depth1], np.repeat(steps[:, None], len(depth1), 1))
    assert (hits <= tries).all() and hits[:, 1:].sum() > 0 and hits[:, 0, 1:].sum() > 0  # later siblings hit too
    # accepted drafts per step = accept length - 1, except the last step of a row may be cut by max_new_tokens
    drafted = (accepted - 1).clip(0).sum(1)
    assert (hits.sum((1, 2)) >= drafted).all() and (hits.sum((1, 2)) <= drafted + tree.depth).all()
