"""A small model as the drafter: lossless (chains, static and dynamic trees), drafting with the target's own
weights accepts every draft, its cache after commits equals a fresh prefill over the committed text, it compiles
once, loads from a Hugging Face checkpoint, and refuses another vocabulary in one line."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax import Generator, LoadedTarget
from amphista_jax.drafters.base import PrefillContext, Proposal
from amphista_jax.drafters.draft_model import DraftModel, DraftModelError
from amphista_jax.engine.decode import generate, pad_prompts, speculative_generate
from amphista_jax.models.hf import save_params
from amphista_jax.models.llama import Output, Transformer, init_params, target_model
from amphista_jax.models.param_layout import has_split_layers, split_layers
from amphista_jax.models.target import Target
from amphista_jax.trees.growth import dynamic_tree
from amphista_jax.trees.names import PRESETS
from amphista_jax.trees.tree import batched, chain, tree_arrays
from amphista_jax.trees.verify import Verdict
from tests.helpers import CONFIG, PROMPTS, assert_compiles_once, assert_greedy_lossless, default_cases

SMALL = dataclasses.replace(CONFIG, num_layers=1, sliding_windows=(0,), hidden_size=32, intermediate_size=64,
                            num_heads=2, num_kv_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def target():
    return Target(CONFIG, init_params(CONFIG, jax.random.key(0)))


# The sampled drafts' path runs by default in test_speculative's chi-square test.
@pytest.mark.parametrize("tree", ["chain-4"] + [pytest.param(t, marks=pytest.mark.slow)
                                               for t in ("sampled", "small-8", "dynamic")])
def test_greedy_draft_model_equals_ar(target, tree):
    """Greedy decoding with top-k drafts, and with drafts sampled at temperature 1 (`sampled`, small-8)."""
    drafter = DraftModel(SMALL, temperature=1.0 if tree == "sampled" else 0.0)
    tree = {"dynamic": dynamic_tree(8, 3, 3), "sampled": PRESETS["small-8"]}.get(tree) or PRESETS[tree]
    assert_greedy_lossless(target, drafter, drafter.init(jax.random.key(1), target), tree, trained=False)


@pytest.mark.parametrize(("tree", "made"), [("chain-4", False), ("chain-4", True),
                                            pytest.param("mc_sim_7b_63", False, marks=pytest.mark.slow)])
@default_cases('chain-4-False')
def test_the_target_as_its_own_draft_model_is_accepted_whole(target, tree, made):
    """Drafting with the target's weights is right at every node iff the draft cache holds exactly the committed
    text and the root: greedy decoding then accepts depth + 1 tokens every step. `made`: the draft model made from
    all of the target's layers (`layers`, no `config`) is the target itself."""
    tokens, lengths = pad_prompts(PROMPTS)
    ar = generate(target.params, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=41, cache_size=64)
    drafter = DraftModel(layers=CONFIG.num_layers) if made else DraftModel(CONFIG)
    params = drafter.init(jax.random.key(5), target) if made else target.params
    spec = speculative_generate(target.params, params, tokens, lengths, jax.random.key(0), config=CONFIG,
                                drafter=drafter, tree=PRESETS[tree], max_new_tokens=41, cache_size=160)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    assert int(spec.steps) == 40 // (PRESETS[tree].depth + 1), int(spec.steps)  # the prefill makes token 1


@pytest.mark.parametrize("vocab", [(), tuple(range(0, CONFIG.vocab_size, 2))])
def test_int8_draft_weights_are_lossless_and_draft_as_the_weights_they_quantize(target, vocab):
    """The target drafting for itself from int8 copies of its projections (`weights="int8"`), over the whole
    vocabulary and a draft vocabulary: decoding reads every projection as int8 (the embedding as loaded), its greedy
    output equals AR's, and nearly every draft is still accepted (the copies draft as the weights they quantize)."""
    split = target.params if has_split_layers(target.params) else split_layers(target.params)
    drafter = DraftModel(CONFIG, draft_vocab=vocab, weights="int8")
    kept = drafter.kept_params(split)
    decoded = drafter.decode_params(kept, target)
    dtypes = {jax.tree_util.keystr(k): v.dtype for k, v in jax.tree_util.tree_leaves_with_path(decoded)}
    assert all(d == jnp.int8 for k, d in dtypes.items() if k.endswith("['weight']")), dtypes
    assert dtypes["['embed']['embedding']"] == jnp.float32 and "['lm_head']['weight']" not in dtypes
    assert decoded["draft_lm_head"]["weight"].shape == (len(vocab) or CONFIG.vocab_size, CONFIG.hidden_size)
    assert_greedy_lossless(target, drafter, kept, PRESETS["chain-4"], trained=False)
    tokens, lengths = pad_prompts(PROMPTS[1:2])
    ar = generate(target.params, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=41, cache_size=64)
    on_vocab = np.isin(np.asarray(ar.tokens[0]), vocab or np.arange(CONFIG.vocab_size)).mean()
    spec = speculative_generate(target.params, split, tokens, lengths, jax.random.key(0), config=CONFIG,
                                drafter=drafter, tree=PRESETS["chain-4"], max_new_tokens=41, cache_size=160)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))  # quantized per generation
    if on_vocab == 1.0:
        assert int(spec.steps) <= 12, int(spec.steps)  # all accepted: 8 steps of 5 tokens; AR takes 40
    with pytest.raises(DraftModelError, match="weights='bf16': choose one of float32, int8"):
        DraftModel(CONFIG, weights="bf16")


@pytest.mark.parametrize("tree", ["chain-4", pytest.param("small-8", marks=pytest.mark.slow)])
def test_the_confidence_stop_is_lossless_and_saves_unsure_depths(tree):
    """The target (sharpened) drafting for itself with `p_min`: greedy output equal to AR's, and the stop both
    cuts drafts (more steps than with every draft accepted) and keeps some (fewer than one token a step), so both
    the drafted and the skipped forwards ran."""
    params = jax.tree.map(lambda x: x * 8 if x.ndim >= 2 else x, init_params(CONFIG, jax.random.key(0)))
    tokens, lengths = pad_prompts(PROMPTS)
    ar = generate(params, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=41, cache_size=64)
    steps = {}
    for p_min in (0.0, 0.05):
        spec = speculative_generate(params, params, tokens, lengths, jax.random.key(0), config=CONFIG,
                                    drafter=DraftModel(CONFIG, p_min=p_min), tree=PRESETS[tree], max_new_tokens=41,
                                    cache_size=160)
        np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
        steps[p_min] = int(spec.steps)
    assert steps[0.0] == 40 // (PRESETS[tree].depth + 1) < steps[0.05] < 40, steps


def test_the_confidence_stop_drafts_only_below_sure_nodes(target):
    """A node is drafted iff its parent was and the distribution it was drawn from (`q`, sampled drafts) gives
    its most likely token at least `p_min`; drafted nodes are the same draws from the same `q` as without the
    stop. `p_min` is the median of those most likely tokens' probabilities, so both outcomes occur."""
    from amphista_jax.drafters.base import DraftContext

    sharp = Target(CONFIG, jax.tree.map(lambda x: x * 8 if x.ndim >= 2 else x, target.params))
    spec = PRESETS["small-8"]
    arrays = tree_arrays(spec)
    drafter = DraftModel(layers=1, temperature=1.0)
    dparams = drafter.init(jax.random.key(1), sharp)
    state = drafter.init_state(CONFIG, 1, 32)

    @functools.partial(jax.jit, static_argnums=2)
    def propose(root, rng, p_min):
        prompt = PrefillContext(Output(None, None, None), jnp.asarray([[5, 9, 33]]), jnp.asarray([3]), root)
        ctx = DraftContext(None, root, jnp.asarray([3]), drafter.prefill(dparams, sharp, prompt, state))
        return dataclasses.replace(drafter, p_min=p_min).propose(dparams, sharp, ctx, spec, rng)

    calls = [(jnp.asarray([i * 7 % CONFIG.vocab_size]), jax.random.key(i)) for i in range(12)]
    whole = [propose(root, rng, 0.0) for root, rng in calls]
    p_min = float(np.median([np.asarray(w.q[0, 1:]).max(-1) for w in whole]))
    seen = set()
    for (root, rng), full in zip(calls, whole, strict=True):
        cut = propose(root, rng, p_min)
        valid, q = np.asarray(cut.tree.valid[0]), np.asarray(cut.q[0])
        np.testing.assert_array_equal(np.asarray(cut.tokens[0])[valid], np.asarray(full.tokens[0])[valid])
        np.testing.assert_allclose(q[valid], np.asarray(full.q[0])[valid], atol=1e-6)
        assert valid[0] and np.asarray(full.tree.valid[0]).all()
        for node in range(1, spec.num_nodes):
            assert valid[node] == (valid[arrays.parent[node]] and q[node].max() >= p_min), (root, node)
            seen.add((int(arrays.depth[node]), bool(valid[node])))
    assert {(1, True), (1, False), (2, True), (2, False)} <= seen, seen


@pytest.mark.slow
def test_cache_after_commits_equals_a_fresh_prefill(target):
    """Prefill, then commits of different accepted counts per row through chain trees of the sequence's own
    tokens: the committed keys/values (text and root) equal a cached forward over that text from scratch. Under
    -m slow: test_the_target_as_its_own_draft_model_is_accepted_whole[chain-4-False] accepts depth + 1 tokens every
    step only if the draft cache holds exactly the committed text and the root."""
    drafter = DraftModel(SMALL)
    params = drafter.init(jax.random.key(1), target)
    seq = jax.random.randint(jax.random.key(3), (2, 40), 0, CONFIG.vocab_size)
    lengths, pad, depth = jnp.asarray([7, 4]), 16, 4
    prompt = jnp.where(jnp.arange(pad)[None] < lengths[:, None], seq[:, :pad], 0)
    root = jnp.take_along_axis(seq, lengths[:, None], 1)[:, 0]
    state = jax.jit(drafter.prefill)(params, target, PrefillContext(Output(None, None, None), prompt, lengths, root),
                                     drafter.init_state(CONFIG, 2, 64))
    commit = jax.jit(drafter.commit)
    model = Transformer(SMALL, split=True)  # the params are in decoding's layout
    for counts in ([1, 3], [5, 1], [2, 5]):
        a = jnp.asarray(counts)
        node_pos = lengths[:, None] + jnp.arange(depth + 1)[None]
        proposal = Proposal(jnp.take_along_axis(seq, node_pos, 1), batched(tree_arrays(chain(depth)), 2))
        nodes = jnp.where(jnp.arange(depth + 1)[None] < a[:, None], jnp.arange(depth + 1)[None], -1)
        bonus = jnp.take_along_axis(seq, (lengths + a)[:, None], 1)[:, 0]
        verify_out = Output(jnp.zeros((2, depth + 1, CONFIG.hidden_size)), None, None)
        state, _ = commit(params, target, proposal, Verdict(nodes, a, bonus), verify_out, state)
        lengths = lengths + a
        cache = state["caches"][0]
        np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(lengths + 1))  # the text and the root
        for row in range(2):
            n = int(lengths[row]) + 1
            fresh = drafter.init_state(CONFIG, 1, 64)["caches"][0]
            out = model.apply({"params": params}, seq[row: row + 1, :n], jnp.arange(n)[None], fresh,
                              return_logits=False)
            for got, want in ((cache.k, out.cache.k), (cache.v, out.cache.v)):
                np.testing.assert_allclose(np.asarray(got[:, row, :n]), np.asarray(want[:, 0, :n]), atol=1e-5)
            np.testing.assert_allclose(np.asarray(state["base"][row]), np.asarray(out.hidden[0, -1]), atol=1e-5)


@pytest.mark.parametrize("p_min", [0.0, 0.1])
def test_generation_compiles_once(target, p_min):
    """With the confidence stop too: which depths run is decided on the device, inside the one program."""
    drafter = DraftModel(SMALL, p_min=p_min)
    params = drafter.init(jax.random.key(1), target)
    assert_compiles_once(target.params, drafter, params, PRESETS["small-16"])


def test_sampled_drafts_are_draws_from_q(target):
    """With temperature > 0 every child is a draw from its parent's draft distribution, which the proposal carries
    as that child's `q`: over many steps' roots the children's frequencies match q (siblings independent)."""
    from amphista_jax.drafters.base import DraftContext
    from amphista_jax.drafters.feature_drafting import FeatureDrafting
    from tests.helpers import CHI2_999, chi_square

    config = dataclasses.replace(SMALL, vocab_size=16)
    tiny = Target(dataclasses.replace(CONFIG, vocab_size=16), init_params(dataclasses.replace(CONFIG, vocab_size=16),
                                                                           jax.random.key(0)))
    drafter = DraftModel(config, temperature=1.0)
    params = jax.tree.map(lambda x: x * 2 if x.ndim >= 2 else x, drafter.init(jax.random.key(1), tiny))
    state = drafter.init_state(tiny.config, 1, 16)
    state = {"base": jax.random.normal(jax.random.key(2), (1, config.hidden_size)), "caches": state["caches"]}
    ctx = DraftContext(None, jnp.asarray([3]), jnp.zeros((1,), jnp.int32), state)
    spec = PRESETS["small-8"]  # the root's three children are i.i.d.

    @jax.jit
    def children(rng):
        proposal = drafter.propose(params, tiny, ctx, spec, rng)
        return proposal.tokens[0, 1:4], proposal.q[0, 1]

    draws, q = jax.vmap(children)(jax.random.split(jax.random.key(5), 3000))
    q = np.asarray(q[0], np.float64)
    np.testing.assert_allclose(np.asarray(FeatureDrafting(drafter, params, tiny, ctx).logprobs(state["base"])),
                               np.log(q)[None], atol=1e-5)
    for rank in range(3):
        assert chi_square(np.bincount(np.asarray(draws[:, rank]), minlength=16), q) < CHI2_999[15]
    assert (np.asarray(draws[:, 0]) != np.asarray(draws[:, 1])).mean() > 0.05  # not copies of one draw


def test_from_pretrained_loads_a_checkpoint_and_refuses_another_vocabulary(target, tmp_path):
    drafter = DraftModel(SMALL)
    params = drafter.init(jax.random.key(1), target)
    save_params(params, SMALL, tmp_path / "draft", dtype="float32")
    loaded, restored = DraftModel.from_pretrained(tmp_path / "draft", CONFIG)
    assert loaded == drafter
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, restored)
    other = dataclasses.replace(SMALL, vocab_size=128)
    save_params(init_params(other, jax.random.key(2)), other, tmp_path / "other", dtype="float32")
    with pytest.raises(DraftModelError, match="vocabulary of 128 tokens but the target has 256"):
        DraftModel.from_pretrained(tmp_path / "other", CONFIG)
    with pytest.raises(DraftModelError, match="vocabulary"):
        DraftModel(other).init(jax.random.key(0), target)


def _embedded_sibling(tmp_path, name: str, **changes) -> str:
    """A random one-layer model of the embedded target's family saved as a HF checkpoint."""
    from amphista_jax.assets import default_model_dir
    from amphista_jax.models.hf import load_config

    small = dataclasses.replace(load_config(default_model_dir()), num_layers=1, sliding_windows=(0,), hidden_size=32,
                                intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16, **changes)
    save_params(init_params(small, jax.random.key(0)), small, tmp_path / name)
    return str(tmp_path / name)


CLI = [sys.executable, "-m", "amphista_jax.cli", "generate", "--prompt", "def add(a, b):", "--max-new-tokens", "12"]


@pytest.mark.slow  # two CLI generations (~30 s); the mechanism is covered in-process above
def test_cli_generate_with_a_draft_model(tmp_path):
    """`generate --draft-model` on the embedded target: the completion equals plain generation's."""
    plain = subprocess.run(CLI, capture_output=True, text=True, check=True).stdout
    spec = subprocess.run(CLI + ["--draft-model", _embedded_sibling(tmp_path, "draft")], capture_output=True,
                          text=True, check=True)
    assert spec.stdout == plain and "tau" in spec.stderr


@pytest.mark.slow
def test_cli_refuses_a_draft_model_with_another_vocabulary(tmp_path):
    """Under -m slow: test_from_pretrained_loads_a_checkpoint_and_refuses_another_vocabulary covers the refusal (a
    `DraftModelError`, a `UserError`, which test_bad_inputs.py's test_heads_of_another_target_shape_are_refused shows
    the CLI reports in one line)."""
    bad = subprocess.run(CLI + ["--draft-model", _embedded_sibling(tmp_path, "wrong", vocab_size=300)],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "vocabulary of 300 tokens" in bad.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_head_accuracy_scores_its_depth1_drafts(target):
    """On the target's own greedy continuation, the target as its own draft model drafts every token right. Under
    -m slow: test_the_whole_target_made_into_a_draft_model_distils_to_its_entropy scores the same loss's depth-1
    drafts at the target's positions (its CE equals the target's own entropy only where they line up)."""
    tokens, lengths = pad_prompts(PROMPTS[:1])
    ar = generate(target.params, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=20, cache_size=64)
    seq = np.concatenate([np.asarray(PROMPTS[0]), np.asarray(ar.tokens[0, :20])])[None]
    mask = (np.arange(seq.shape[1]) >= len(PROMPTS[0]))[None].astype(np.int32)
    _, metrics = DraftModel(CONFIG).loss(target.params, target, {"tokens": seq, "loss_mask": mask}, None)
    assert float(metrics["head0/top1"]) == 1.0


def test_eval_spec_names_a_model_directory(target, tmp_path):
    from amphista_jax.evals.methods import DRAFT_MODEL, MethodSpecError, resolve_method

    drafter = DraftModel(SMALL)
    save_params(drafter.init(jax.random.key(1), target), SMALL, tmp_path / "draft", dtype="float32")
    method = resolve_method(f"small={tmp_path / 'draft'}@chain-2", "auto", target.config)
    assert (method.label, method.method, method.drafter, method.tree) == ("small", DRAFT_MODEL, drafter, chain(2))
    gen = method.generator(Generator.load(LoadedTarget.from_params(target.config, target.params)))
    assert "config.json" in method.heads_files and gen.draft_params is not None
    other = dataclasses.replace(SMALL, vocab_size=128)
    save_params(init_params(other, jax.random.key(2)), other, tmp_path / "other", dtype="float32")
    with pytest.raises(MethodSpecError, match="vocabulary of 128 tokens"):
        resolve_method(str(tmp_path / "other"), "chain-2", target.config)
    # A run at T > 0 samples the drafts at its temperature on a static tree (classic speculative sampling);
    # EAGLE-2's dynamic tree keeps top-k drafts, and `#temperature=0` asks for top-k drafts on any tree.
    path = str(tmp_path / "draft")
    assert [resolve_method(spec, "auto", temperature=0.7).drafter.temperature
            for spec in (path, f"{path}@dynamic-8x3x2", f"{path}#temperature=0")] == [0.7, 0.0, 0.0]
    assert resolve_method(path, "auto").drafter.temperature == 0.0
    with pytest.raises(MethodSpecError, match="dynamic tree"):
        resolve_method(f"{path}@dynamic-8x3x2#temperature=1.0", "auto")


# A draft model made from the target's first layers (`layers`, trained by `amphista-jax train`).
MADE = DraftModel(layers=1, draft_vocab=tuple(range(0, CONFIG.vocab_size, 2)))


def test_a_made_draft_model_starts_as_the_targets_first_layers(target):
    """Its own fp32 copies of the target's embedding, first layer, final norm and projection; more layers than the
    target has: one line naming the fix."""
    params = MADE.init(jax.random.key(0), target)
    assert set(params) == {"embed", "layer_0", "final_norm", "lm_head"}  # CONFIG's projection is untied
    split = target.params if has_split_layers(target.params) else split_layers(target.params)  # decoding's layout
    want = {k: split[k] for k in ("embed", "final_norm", "lm_head", "layer_0")}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), want, params)
    with pytest.raises(DraftModelError, match="layers=3 but the target has 2 layers: set layers to at most 2"):
        DraftModel(layers=3).init(jax.random.key(0), target)
    with pytest.raises(ValueError, match="layers=0 must be an integer >= 1"):
        DraftModel(layers=0)


@pytest.mark.parametrize("tree", ["chain-4", "dynamic", pytest.param("small-8", marks=pytest.mark.slow)])
@default_cases('dynamic')
def test_greedy_made_draft_model_over_a_draft_vocabulary_equals_ar(target, tree):
    tree = dynamic_tree(8, 3, 3) if tree == "dynamic" else PRESETS[tree]
    assert_greedy_lossless(target, MADE, MADE.init(jax.random.key(1), target), tree, trained=False)


def test_made_draft_model_distils_the_target_and_round_trips(target, tmp_path):
    """Its loss is the CE against the target's next-token distribution over its draft vocabulary (its CE on the
    tokens reported beside it), a few steps lower it (on a target with a peaked distribution: a random one's is
    nearly uniform, the floor of that CE), and `draft.json` + params load back as they were saved."""
    from amphista_jax.drafters.io import load_draft, save_draft
    from tests.helpers import assert_trains

    params = MADE.init(jax.random.key(0), target)
    tokens = jax.random.randint(jax.random.key(6), (2, 16), 0, CONFIG.vocab_size)
    batch = {"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}
    out = Transformer(CONFIG).apply({"params": target.params}, tokens, jnp.broadcast_to(jnp.arange(16), (2, 16)))
    loss, metrics = MADE.loss(params, target, batch, out)
    np.testing.assert_allclose(float(loss), float(metrics["head0/distill"]), rtol=1e-6)
    assert float(metrics["head0/loss"]) > 0
    peaked = {"lm_head": {"kernel": target.params["lm_head"]["kernel"] * 20}}
    assert_trains(MADE, Target(CONFIG, target.params | peaked))
    save_draft(tmp_path / "heads", "draft_model", MADE, params, CONFIG)
    method, loaded, restored = load_draft(tmp_path / "heads", CONFIG, target.params)
    assert (method, loaded) == ("draft_model", MADE)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, restored)


def test_the_whole_target_made_into_a_draft_model_distils_to_its_entropy():
    """Made from every layer of a tied-embedding target held in the split layout, the draft model is that target:
    its distillation CE for token t + 2 (its output at t + 1 against the target's logits there) is the target's
    own entropy at t + 1."""
    config = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    params = split_layers(init_params(config, jax.random.key(4)))
    target = Target(config, params)
    drafter = DraftModel(layers=config.num_layers)
    heads = drafter.init(jax.random.key(0), target)
    assert set(heads) == {"embed", "final_norm", "layer_0", "layer_1"}  # tied: no projection of its own
    tokens = jax.random.randint(jax.random.key(7), (2, 16), 0, config.vocab_size)
    out = target_model(config, params).apply({"params": params}, tokens, jnp.broadcast_to(jnp.arange(16), (2, 16)))
    _, metrics = drafter.loss(heads, target, {"tokens": tokens, "loss_mask": jnp.ones_like(tokens)}, out)
    logp = jax.nn.log_softmax(out.logits[:, 1:15])
    entropy = -(jnp.exp(logp) * logp).sum(-1).mean()
    np.testing.assert_allclose(float(metrics["head0/distill"]), float(entropy), rtol=1e-5)


def test_a_draft_model_is_read_once_per_target_for_all_its_trees_and_decoding_settings(target, tmp_path):
    """Attachments of one draft model's directory to one target share one copy of its params, each with its own tree
    and decoding settings (`p_min`, a draft vocabulary); int8 `weights` keep a copy of their own (other params); every
    one decodes as AR."""
    path = tmp_path / "draft"
    save_params(DraftModel(SMALL).init(jax.random.key(1), target), SMALL, path, dtype="float32")
    ar = Generator.load(LoadedTarget.from_params(target.config, target.params))
    plain = ar.with_drafter(path, tree="chain-3")
    sure = ar.with_drafter(path, tree="chain-2", settings={"p_min": 0.3, "draft_vocab": list(range(0, 256, 2))})
    quarter = ar.with_drafter(path, tree="chain-3", settings={"weights": "int8"})
    assert (plain.drafter.p_min, sure.drafter.p_min, len(sure.drafter.draft_vocab)) == (0.0, 0.3, 128)
    assert (plain.tree, sure.tree) == (chain(3), chain(2)) and quarter.drafter.weights == "int8"
    plain_leaves, sure_leaves = jax.tree.leaves(plain.draft_params), jax.tree.leaves(sure.draft_params)
    assert all(a is b for a, b in zip(plain_leaves, sure_leaves, strict=True))
    assert not any(a is b for a in plain_leaves for b in jax.tree.leaves(quarter.draft_params))
    want = ar.generate(PROMPTS, max_new_tokens=12).token_ids
    for gen in (plain, sure, quarter):
        assert gen.generate(PROMPTS, max_new_tokens=12).token_ids == want
    ar.target.release_draft_models()  # read again after
    again = jax.tree.leaves(ar.with_drafter(path, tree="chain-3").draft_params)
    assert not any(a is b for a, b in zip(plain_leaves, again, strict=True))
    jax.tree.map(np.testing.assert_array_equal, plain_leaves, again)
