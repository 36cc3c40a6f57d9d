"""Draft vocabularies (`drafters/draft_vocab.py`): decoding stays lossless with tokens outside the vocabulary,
drafts stay inside it, the whole vocabulary changes nothing, the loss masks labels outside it, settings round-trip
through draft.json, trees ranking more siblings than it holds are refused, and the trainer's frequency count.
Also Medusa's shared-projection variant."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.drafters import Amphista, BiTA, Eagle, Gumiho, Hydra, Medusa, SemiAutoregressive
from amphista_jax.drafters.draft_vocab import most_frequent, to_draft, to_target, token_counts
from amphista_jax.drafters.io import load_draft, save_draft
from amphista_jax.drafters.losses import head_metrics
from amphista_jax.engine.decode import generate, pad_prompts, spec_init, spec_propose
from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.models.llama import init_params
from amphista_jax.models.target import Target
from amphista_jax.trees.names import get_tree
from amphista_jax.trees.tree import TreeError, TreeSpec
from tests.helpers import CONFIG, PROMPTS, assert_greedy_lossless, assert_trains, default_cases


@pytest.fixture(scope="module")
def target() -> Target:
    return Target(CONFIG, init_params(CONFIG, jax.random.key(0)))


@pytest.fixture(scope="module")
def continuation(target: Target) -> np.ndarray:
    """The target's greedy continuations of PROMPTS (what `assert_greedy_lossless` compares with)."""
    tokens, lengths = pad_prompts(PROMPTS)
    ar = generate(target.params, tokens, lengths, jax.random.key(0), config=CONFIG, max_new_tokens=40, cache_size=64)
    return np.asarray(ar.tokens)


@pytest.fixture(scope="module")
def vocab(continuation: np.ndarray) -> tuple[int, ...]:
    """A 96-token draft vocabulary holding every other token of the continuations and none of the rest."""
    seen = np.unique(continuation)
    inside, outside = seen[::2], seen[1::2]
    others = np.setdiff1d(np.arange(CONFIG.vocab_size), seen)[: 96 - len(inside)]
    chosen = tuple(sorted(int(i) for i in np.concatenate([inside, others])))
    assert len(outside) and not set(outside) & set(chosen)  # the reference continues with tokens outside it
    return chosen


def proposal_tokens(target: Target, drafter, params, tree) -> np.ndarray:
    """Node tokens `[B, N]` of the first proposal after prefilling PROMPTS."""
    settings = DecodeSpec(CONFIG, drafter, tree, max_new_tokens=8)
    tokens, lengths = pad_prompts(PROMPTS)

    @jax.jit
    def first(params, draft_params):
        state = spec_init(params, draft_params, tokens, lengths, jax.random.key(1), 64, settings)
        return spec_propose(params, draft_params, state, settings).tokens

    return np.asarray(first(target.params, params))


def case(drafter, tree: str, *marks: pytest.MarkDecorator):
    return pytest.param(drafter, tree, marks=marks, id=f"{drafter.name}-{tree}")


GREEDY = [case(Medusa(num_heads=3), "small-8"), case(Hydra(num_heads=3), "small-8"), case(Eagle(), "small-8"),
          case(Eagle(), "dynamic-8x4x2")]


@pytest.mark.parametrize("drafter, tree", GREEDY)
@default_cases('medusa-small-8')
def test_greedy_lossless_with_a_draft_vocabulary(target, vocab, drafter, tree):
    """Under -m slow for EAGLE and Hydra: test_drafts_stay_inside_and_the_whole_vocabulary_changes_nothing's
    [eagle-dynamic-8x4x2] and [hydra-small-8] cover their drafting over a draft vocabulary, and test_draft_model.py's
    test_greedy_made_draft_model_over_a_draft_vocabulary_equals_ar[dynamic] decodes a dynamic tree over one
    losslessly."""
    drafter = dataclasses.replace(drafter, draft_vocab=vocab)
    assert_greedy_lossless(target, drafter, drafter.init(jax.random.key(1), target), get_tree(tree), trained=False)


# Every method with a draft vocabulary; EAGLE's static tree (the same `FeatureDrafting.top_k` as its dynamic one,
# and decoded losslessly above) only with `-m slow`.
DRAFTERS = [case(Medusa(num_heads=3), "small-8"), case(Medusa(num_heads=3, shared_lm_head=True), "small-8"),
            case(Hydra(num_heads=3), "small-8"),
            case(Amphista(num_heads=3, adaptation_stages=1, lm_head_rank=8), "small-8"),
            case(SemiAutoregressive(num_heads=3), "small-8"), case(Eagle(), "dynamic-8x4x2"),
            case(Gumiho(mlp_heads=2, mlp_layers=1, top_k=2, fta_nodes=2), "dynamic-12x4x2"),
            case(Eagle(), "small-8", pytest.mark.slow)]


@pytest.mark.parametrize("drafter, tree", DRAFTERS)
@default_cases('medusa-small-8_1', 'hydra-small-8', 'eagle-dynamic-8x4x2')
def test_drafts_stay_inside_and_the_whole_vocabulary_changes_nothing(target, vocab, drafter, tree):
    """Under -m slow for plain Medusa ([medusa-small-8_0]):
    test_medusa_logits_over_a_draft_vocabulary_are_the_full_logits_columns shows its logits are the full logits'
    columns, and [medusa-small-8_1] runs the same `Medusa.propose` over a draft vocabulary."""
    tree = get_tree(tree)
    key = jax.random.key(1)
    perturb = lambda p: jax.tree.map(lambda x: x + 0.05 * jax.random.normal(key, x.shape), p)  # noqa: E731
    small = dataclasses.replace(drafter, draft_vocab=vocab)
    drafted = proposal_tokens(target, small, perturb(small.init(key, target)), tree)[:, 1:]
    assert set(drafted.ravel().tolist()) <= set(vocab)
    whole = dataclasses.replace(drafter, draft_vocab=tuple(range(CONFIG.vocab_size)))
    params = perturb(drafter.init(key, target))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 drafter.init(key, target), whole.init(key, target))
    np.testing.assert_array_equal(proposal_tokens(target, whole, params, tree),
                                  proposal_tokens(target, drafter, params, tree))


def test_medusa_logits_over_a_draft_vocabulary_are_the_full_logits_columns(target, vocab):
    hidden = jax.random.normal(jax.random.key(2), (3, CONFIG.hidden_size))
    for shared in (False, True):
        full = Medusa(num_heads=2, shared_lm_head=shared)
        small = dataclasses.replace(full, draft_vocab=vocab)
        params = full.init(jax.random.key(1), target)
        params["w"] = jax.random.normal(jax.random.key(3), params["w"].shape) * 0.2
        small_params = params | ({} if shared else {"lm_head": params["lm_head"][:, :, np.asarray(vocab)]})
        np.testing.assert_array_equal(np.asarray(small.head_logits(small_params, target, hidden)),
                                      np.asarray(full.head_logits(params, target, hidden))[..., np.asarray(vocab)])


def test_labels_outside_are_left_out_of_the_ce_and_count_as_misses():
    vocab = (1, 4, 6)
    labels = jnp.array([[4, 5, 6, 0]])  # 5 and 0 are outside
    assert to_draft(labels, vocab)[0].tolist() == [[1, 0, 2, 0]]
    assert to_draft(labels, vocab)[1].tolist() == [[True, False, True, False]]
    assert to_target(jnp.array([2, 0, 1]), vocab).tolist() == [6, 1, 4]
    logits = jnp.log(jnp.array([[[0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [0.5, 0.3, 0.2], [0.9, 0.05, 0.05]]]))
    loss, metrics = head_metrics(logits, labels, jnp.ones((1, 4)), vocab)
    np.testing.assert_allclose(float(loss), -(np.log(0.8) + np.log(0.2)) / 2, rtol=1e-6)  # positions 0 and 2 only
    assert float(metrics["top1"]) == 0.25  # position 0 is a hit; 1 and 3 (argmax 0 = token 1) are misses
    assert float(metrics["top5"]) == 0.5  # every inside label is within the 3 candidates


@pytest.mark.slow
def test_heads_over_a_draft_vocabulary_train(target, vocab):
    """Under -m slow: test_labels_outside_are_left_out_of_the_ce_and_count_as_misses covers the draft-vocabulary CE
    these heads train on, and test_draft_model.py's test_made_draft_model_distils_the_target_and_round_trips that a
    drafter over a draft vocabulary trains (`assert_trains`)."""
    assert_trains(Medusa(num_heads=2, draft_vocab=vocab), target)
    assert_trains(Hydra(num_heads=2, lm_weight=0.5, teacher_weight=1.0, draft_vocab=vocab), target)


def test_draft_json_round_trip_and_rank_check(target, vocab, tmp_path):
    medusa = Medusa(num_heads=2, draft_vocab=vocab)
    params = medusa.init(jax.random.key(1), target)
    assert params["lm_head"].shape == (2, CONFIG.hidden_size, len(vocab))
    save_draft(tmp_path / "heads", "medusa", medusa, params, CONFIG)
    _, loaded, _ = load_draft(tmp_path / "heads", CONFIG, target.params)
    assert loaded == medusa and isinstance(loaded.draft_vocab, tuple) and hash(loaded) == hash(medusa)
    assert Medusa(draft_vocab=[2, 3]) == Medusa(draft_vocab=(2, 3))  # lists (as JSON gives them) become tuples
    tiny = Medusa(num_heads=2, draft_vocab=(1, 2, 3))
    assert tiny.rankable(CONFIG.vocab_size) == 3
    tiny.check_tree(get_tree("chain-1"), CONFIG.vocab_size)
    with pytest.raises(TreeError, match="ranks 4 siblings but medusa drafts from 3 tokens"):
        tiny.check_tree(TreeSpec(((0,), (1,), (2,), (3,))), CONFIG.vocab_size)
    with pytest.raises(ValueError, match="sorted, distinct"):
        Medusa(draft_vocab=(3, 2))
    with pytest.raises(ValueError, match="outside the target's 256 tokens"):
        Medusa(draft_vocab=(1, 256)).init(jax.random.key(0), target)


def test_frequency_count_on_a_hand_made_batch():
    tokens = np.array([[5, 7, 7, 2, 9], [7, 2, 2, 5, 9]])
    mask = np.array([[0, 1, 1, 1, 1], [0, 0, 1, 1, 0]])  # labels: 7 7 2 9 | 2 5
    counts = token_counts(tokens, mask, 10)
    assert counts.tolist() == [0, 0, 2, 0, 0, 1, 0, 2, 0, 1]
    assert most_frequent(counts, 2) == (2, 7)  # a tie, both counted twice
    assert most_frequent(counts, 3) == (2, 5, 7)  # 5 and 9 tie at 1: the lower id
    assert most_frequent(counts, 10) == tuple(range(10))
    with pytest.raises(ValueError, match="draft_vocab_size=11 must be in"):
        most_frequent(counts, 11)


def test_shared_projection_medusa_is_small_and_lossless(target):
    big = dataclasses.replace(CONFIG, vocab_size=2 * CONFIG.vocab_size)
    shared = Medusa(num_heads=3, shared_lm_head=True)
    sizes = [sum(x.size for x in jax.tree.leaves(shared.init(jax.random.key(0), Target(c, init_params(c, key)))))
             for c, key in ((CONFIG, jax.random.key(0)), (big, jax.random.key(0)))]
    assert sizes[0] == sizes[1] == 3 * (CONFIG.hidden_size**2 + CONFIG.hidden_size)
    params = shared.init(jax.random.key(1), target)
    params["w"] = jax.random.normal(jax.random.key(3), params["w"].shape) * 0.1
    assert_greedy_lossless(target, shared, params, get_tree("small-8"), trained=False)


def test_the_trainer_chooses_the_most_frequent_label_tokens():
    from amphista_jax.train.config import DataConfig, TrainConfig
    from amphista_jax.train.examples import choose_draft_vocab

    data = DataConfig(train="x")
    cfg = TrainConfig(data, drafter=Eagle(num_layers=1), draft_vocab_size=2)
    assert cfg.trained_drafter() == Eagle(draft_vocab=(0, 1))  # same shapes as the chosen one: for checks and plans
    assert cfg.trained_drafter((3, 5)) == Eagle(draft_vocab=(3, 5)) and cfg.drafter == Eagle()
    examples = [{"tokens": np.array([5, 7, 7, 2]), "loss_mask": np.array([0, 1, 1, 1])},
                {"tokens": np.array([9, 2, 9, 9]), "loss_mask": np.array([1, 1, 0, 0])}]
    assert choose_draft_vocab(cfg, examples, 10) == (2, 7)  # 7 7 2 | 9 2: 2 and 7 twice, 9 once
    assert choose_draft_vocab(TrainConfig(data), examples, 10) is None
    for settings, error in (({"draft_vocab_size": -1}, "draft_vocab_size=-1 must be an integer >= 0"),
                            ({"draft_vocab_size": True}, "draft_vocab_size=True must be an integer >= 0"),
                            ({"draft_vocab_size": 4, "drafter": Medusa(draft_vocab=(1,))},
                             "draft_vocab_size=4 and drafter.draft_vocab both give the draft vocabulary")):
        with pytest.raises(ValueError, match=error):
            TrainConfig(data, **settings)
    with pytest.raises(ValueError, match="bita drafts over the target's own logits"):
        TrainConfig(data, drafter=BiTA(), draft_vocab_size=4)
