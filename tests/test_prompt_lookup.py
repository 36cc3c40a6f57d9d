"""Prompt lookup: the matching on hand-made sequences (the most recent match wins, n falls back from max to min, no
match drafts nothing, continuations stop at the known text, each branch of a tree the best match with a new first
token), greedy lossless (chains and fans) (batch 1 and 3, ragged prompts, rows
with and without matches; the embedded model through `Generator`, where it drafts repeated text), one compile, the
target's distribution under rejection sampling, and its use by name with no heads: Generator, CLI, eval specs,
and `train` refusing it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax import Generator, LoadedTarget
from amphista_jax.drafters import DRAFTERS, VARIANTS
from amphista_jax.drafters.base import DraftContext
from amphista_jax.drafters.prompt_lookup import NothingToTrainError, PromptLookup, lookup
from amphista_jax.engine.decode import generate, pad_prompts, speculative_generate
from amphista_jax.engine.decode_spec import scratch_slots
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import Transformer, init_params
from amphista_jax.models.target import Target
from amphista_jax.trees.growth import dynamic_tree
from amphista_jax.trees.names import PRESETS
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.tree import TreeError, TreeSpec, chain, fan
from amphista_jax.trees.verify import AcceptanceConfig
from tests.helpers import CHI2_999, CONFIG, PROMPTS, assert_compiles_once, chi_square, default_cases

DRAFTER = PromptLookup()


@pytest.fixture(scope="module")
def target():
    return Target(CONFIG, init_params(CONFIG, jax.random.key(0)))


def _branches(row: list[int], branches: int, depth: int = 4, max_ngram: int = 3, min_ngram: int = 1,
              width: int = 24) -> list[list[int]]:
    """The drafts of each branch of one known text `row` (padded with junk past its length): only the known ones."""
    history = jnp.asarray([row + [99] * (width - len(row))], jnp.int32)
    drafts, known = lookup(history, jnp.asarray([len(row)]), max_ngram, min_ngram, depth, branches)
    return [[int(t) for t, k in zip(d, kn, strict=True) if k] for d, kn in zip(np.asarray(drafts[0]),
                                                                               np.asarray(known[0]), strict=True)]


def _lookup(row: list[int], depth: int = 4, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The chain's drafts (one branch) of one known text `row`."""
    return _branches(row, 1, depth, max_ngram, min_ngram)[0]


def test_the_most_recent_match_of_the_longest_ngram_wins():
    # 3-gram [1, 2, 3] occurs at 0 and 4; the later one is followed by 7 5 ...
    assert _lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 6, 8, 1, 2, 3]) == [7, 5, 6, 8]
    # the 3-gram [6, 1, 2] occurs once (followed by 4) though the 2-gram [1, 2] recurs later (followed by 3)
    assert _lookup([6, 1, 2, 4, 0, 1, 2, 3, 5, 6, 1, 2]) == [4, 0, 1, 2]


def test_n_falls_back_from_max_to_min():
    row = [4, 1, 2, 8, 9, 5, 2, 6, 7]  # [6, 7, 2] and [7, 2] never recur; 2 does, most recently at 6
    assert _lookup(row + [2]) == [6, 7, 2]
    assert _lookup([3, 5, 2, 8, 9, 3, 5, 2], max_ngram=3) == [8, 9, 3, 5]  # the 3-gram itself
    assert _lookup(row + [2], min_ngram=2) == []  # 1-grams not allowed: nothing
    assert _lookup([5, 7, 1, 7, 2, 5, 7]) == [1, 7, 2, 5]  # [5, 7] at 0, not the later 7 at 3
    assert _lookup([5, 7, 1, 7, 2, 5, 7], max_ngram=1) == [2, 5, 7]  # 1-grams only: the 7 at 3


def test_no_match_drafts_nothing():
    assert _lookup([1, 2, 3, 4, 5]) == []
    assert _lookup([7]) == []  # a lone token has no earlier window
    assert _lookup([]) == []


def test_a_continuation_stops_at_the_known_text():
    # the most recent match of [5, 6] is at 3: only 5 6 (through the root) are known after it
    assert _lookup([1, 2, 3, 5, 6, 5, 6]) == [5, 6]
    assert _lookup([8, 8, 8, 8]) == [8]  # the 3-gram at 0 is followed by the root alone
    assert _lookup([1, 2, 3, 4, 1], depth=2) == [2, 3]  # the chain's depth caps it too


def test_each_branch_is_the_best_match_with_a_new_first_token():
    # [1, 2] recurs at 0, 5 and 10: the latest continues 5 9 0; the one at 0 also continues with 5, so the next
    # branch is the one at 5 (7 8 4); no third match has a new first token
    row = [1, 2, 5, 6, 3, 1, 2, 7, 8, 4, 1, 2, 5, 9, 0, 1, 2]
    assert _branches(row, 3) == [[5, 9, 0, 1], [7, 8, 4, 1], []]
    # the 3-gram [3, 1, 2] (continued by 5) ranks before the later 1-gram 2 (continued by 7): longest n first
    assert _branches([3, 1, 2, 5, 4, 2, 7, 6, 3, 1, 2], 2) == [[5, 4, 2, 7], [7, 6, 3, 1]]
    assert _branches([1, 2, 3, 4, 5], 2) == [[], []]  # no match: no branch drafts


def test_lookup_is_per_row_in_a_batch():
    rows = [[1, 2, 3, 1, 2], [4, 5, 6, 7, 8, 9, 0, 0], [3, 3]]
    history = jnp.asarray([r + [0] * (10 - len(r)) for r in rows], jnp.int32)
    drafts, known = lookup(history, jnp.asarray([5, 6, 2]), 3, 1, 3)
    np.testing.assert_array_equal(np.asarray(known[:, 0]), [[True] * 3, [False] * 3, [True, False, False]])
    assert np.asarray(drafts)[0, 0].tolist() == [3, 1, 2] and int(drafts[2, 0, 0]) == 3


def test_nodes_without_a_draft_are_padding_that_is_never_accepted(target):
    """A row whose continuation reaches the root after three tokens drafts three nodes, a row with no match none:
    the rest of the chain is invalid, sees only itself, is seen by no real node and lies on no path."""
    state = {"history": jnp.asarray([[1, 2, 3, 1, 2, 3, 0, 0], [1, 2, 3, 4, 5, 6, 0, 0]], jnp.int32),
             "length": jnp.asarray([5, 6])}  # row 0: [.., 1, 2] matches at 0, then 3, 1, 2 known; row 1: none
    ctx = DraftContext(jnp.zeros((2, CONFIG.hidden_size)), jnp.asarray([2, 6]), jnp.asarray([4, 5]), state)
    proposal = DRAFTER.propose({}, target, ctx, chain(4), jax.random.key(0))
    assert proposal.q is None
    np.testing.assert_array_equal(np.asarray(proposal.tokens), [[2, 3, 1, 2, 2], [6, 6, 6, 6, 6]])
    np.testing.assert_array_equal(np.asarray(proposal.tree.valid), [[1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(np.asarray(proposal.tree.paths), [[[0, 1, 2, 3, -1]], [[0, -1, -1, -1, -1]]])
    mask = np.asarray(proposal.tree.mask)
    np.testing.assert_array_equal(mask[1], np.eye(5, dtype=bool))
    np.testing.assert_array_equal(mask[0, 4], np.eye(5, dtype=bool)[4])


def test_a_fan_drafts_each_branch_and_no_other_children(target):
    """Row 0 has two matches with distinct continuations, row 1 one: `[[0], [1], [0, 0], [0, 1], [1, 0]]` drafts
    branch 0 at [0] / [0, 0], branch 1 at [1] / [1, 0]; [0, 1] (a second child below depth 1) never drafts."""
    tree = TreeSpec(((0,), (1,), (0, 0), (0, 1), (1, 0)))
    assert tree.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0))  # nodes 1..5 in this order
    state = {"history": jnp.asarray([[1, 2, 5, 6, 1, 2, 7, 8, 1, 2, 0], [4, 1, 2, 5, 6, 4, 1, 2, 0, 0, 0]],
                                    jnp.int32), "length": jnp.asarray([10, 8])}
    ctx = DraftContext(jnp.zeros((2, CONFIG.hidden_size)), jnp.asarray([2, 2]), jnp.asarray([9, 7]), state)
    proposal = DRAFTER.propose({}, target, ctx, tree, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(proposal.tree.valid), [[1, 1, 1, 1, 0, 1], [1, 1, 0, 1, 0, 0]])
    tokens = np.asarray(proposal.tokens)
    assert tokens[0, [0, 1, 2, 3, 5]].tolist() == [2, 7, 5, 8, 6] and tokens[1, [1, 3]].tolist() == [5, 6]


# Decoding ------------------------------------------------------------------------------------------------------

REPEATING = [[5, 9, 33, 8, 5, 9, 33, 8, 5, 9], [11, 12], [7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]]


# Ragged rows: a prompt that repeats, a short one, one with no match in it (nor in its output), and alone.
@pytest.mark.parametrize("tree", [chain(4), fan(3, 3)], ids=["chain-4", "fan-3x3"])
@pytest.mark.parametrize("prompts", [[REPEATING[0], [11, 12], PROMPTS[2]], REPEATING[2:]], ids=["batch-3", "batch-1"])
@default_cases('batch-3-fan-3x3')
def test_greedy_prompt_lookup_equals_ar(target, prompts, tree):
    """By default the ragged batch of 3 on the fan runs: a chain is the fan's one-branch case of the same `lookup`
    and `propose`, and a batch of one adds no code path to the ragged batch."""
    tokens, lengths = pad_prompts(prompts)
    kw = dict(config=CONFIG, max_new_tokens=40)
    ar = generate(target.params, tokens, lengths, jax.random.key(0), cache_size=64, **kw)
    spec = speculative_generate(target.params, {}, tokens, lengths, jax.random.key(0), drafter=DRAFTER,
                                tree=tree, cache_size=80, **kw)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(spec.num_tokens), np.asarray(ar.num_tokens))
    assert np.asarray(spec.drafted).sum() > 0  # a random target's greedy text loops: drafts from its own output


def test_typical_acceptance_takes_its_drafts(target):
    tokens, lengths = pad_prompts(REPEATING)
    out = speculative_generate(target.params, {}, tokens, lengths, jax.random.key(1), config=CONFIG, drafter=DRAFTER,
                               tree=chain(4), max_new_tokens=24, cache_size=64, sampling=SamplingConfig(0.5),
                               acceptance=AcceptanceConfig("typical"))
    assert np.asarray(out.drafted).sum() > 0 and (np.asarray(out.accept_lengths) <= 5).all()
    np.testing.assert_array_equal(np.asarray(out.num_tokens), 24)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
def test_sharded_decoding_equals_one_device():
    """The target sharded over (data=2, fsdp=2, tensor=2) decodes one device's tokens. Under -m slow:
    test_sharding.py's test_sharded_speculative_generate_equals_one_device[medusa] covers sharded speculative
    decoding against one device, and test_lookup_is_per_row_in_a_batch that prompt lookup's state is per row."""
    from amphista_jax.engine.sharding import make_mesh, on_mesh, place_for_decoding
    from amphista_jax.models.param_layout import split_layers

    params = split_layers(init_params(CONFIG, jax.random.key(0)))
    tokens, lengths = pad_prompts(REPEATING + [[7, 7, 8]])
    kw = dict(config=CONFIG, drafter=DRAFTER, tree=chain(4), max_new_tokens=12, cache_size=48)
    one = speculative_generate(params, {}, tokens, lengths, jax.random.key(0), **kw)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded, draft = place_for_decoding(mesh, CONFIG, params, DRAFTER, {})
    with on_mesh(mesh):
        out = speculative_generate(sharded, draft, tokens, lengths, jax.random.key(0), **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))


def test_generation_compiles_once(target):
    assert_compiles_once(target.params, DRAFTER, {}, chain(4))


@pytest.mark.slow
def test_the_embedded_model_drafts_repeated_text_and_stays_lossless():
    """Under -m slow: test_cli_generate_draft_prompt_lookup_and_the_demo_method loads it by name on the embedded
    model (through `Generator`), and test_greedy_prompt_lookup_equals_ar[batch-3-fan-3x3] covers that its drafts are
    taken and decoding stays lossless."""
    gen = Generator.load(heads="prompt_lookup", tree="chain-4")
    assert gen.method == "prompt_lookup" and gen.notes == () and gen.draft_params == {}
    body = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    prompt = body + body + "def add(a, b):\n"
    out = gen.generate([prompt, "import os\n"], max_new_tokens=24)
    ar = gen.autoregressive().generate([prompt, "import os\n"], max_new_tokens=24)
    assert out.token_ids == ar.token_ids
    assert out.tau[0] > 1.5, out.tau


@pytest.mark.parametrize("tree", [chain(4), fan(2, 2)], ids=["chain-4", "fan-2x2"])
@default_cases('fan-2x2')
def test_rejection_sampling_keeps_the_target_distribution(tree):
    """Many rows of one prompt, temperature 1 on a 16-token vocabulary: the second generated token's marginal
    equals the exact one computed from the target. The prompt is [3, 7, 1] and the start of the target's own
    greedy text after it, which goes on 4 3 3 3: a first token 4 then drafts the 3 that followed it, often right;
    on the fan a first token 3 drafts two siblings (3 and 7, the two tokens that followed a 3). By default the fan
    runs: its walk down each branch is the chain's, with the rejection of a sibling added."""
    config = tiny_llama_config(vocab_size=16)
    params = jax.tree.map(lambda x: x * 8 if x.ndim >= 2 else x, init_params(config, jax.random.key(5)))
    prompt, rows = [3, 7, 1, 8, 9, 11, 4, 3], 4000
    tokens, lengths = pad_prompts([prompt] * rows, length=8)
    out = speculative_generate(params, {}, tokens, lengths, jax.random.key(9), config=config, drafter=DRAFTER,
                               tree=tree, max_new_tokens=3, cache_size=8 + 3 + scratch_slots(DRAFTER, tree),
                               sampling=SamplingConfig(temperature=1.0))
    model = Transformer(config)
    t = len(prompt)
    first = jax.nn.softmax(model.apply({"params": params}, jnp.asarray([prompt]), jnp.arange(t)[None]).logits[0, -1])
    seqs = jnp.asarray([prompt + [x] for x in range(16)])
    cond = jax.nn.softmax(model.apply({"params": params}, seqs, jnp.broadcast_to(jnp.arange(t + 1), (16, t + 1))
                                      ).logits[:, -1])
    exact = np.asarray(first @ cond)
    assert np.asarray(out.drafted)[:, 1].mean() > 0.1  # the second token often comes from an accepted draft
    assert chi_square(np.bincount(np.asarray(out.tokens[:, 1]), minlength=16), exact / exact.sum()) < CHI2_999[15]


# No heads, nothing to train ------------------------------------------------------------------------------------

def test_registered_by_name_with_nothing_to_train(target):
    assert DRAFTERS["prompt_lookup"] is PromptLookup and VARIANTS["prompt_lookup"] == DRAFTER
    assert not DRAFTER.trainable and all(cls.trainable for name, cls in DRAFTERS.items() if name != "prompt_lookup")
    assert DRAFTER.init(jax.random.key(0), target) == {}
    with pytest.raises(NothingToTrainError, match="no parameters to train"):
        DRAFTER.loss({}, target, {}, None)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="branches"):
        PromptLookup(branches=0)


def test_a_tree_ranking_more_matches_than_its_branches_or_a_budget_is_refused():
    DRAFTER.check_tree(PRESETS[DRAFTER.paper_tree], CONFIG.vocab_size)
    DRAFTER.check_tree(PRESETS["small-8"], CONFIG.vocab_size)  # 3 root children: up to 4 branches by default
    with pytest.raises(TreeError, match="fewer children per node"):
        PromptLookup(branches=1).check_tree(PRESETS["small-8"], CONFIG.vocab_size)
    with pytest.raises(TreeError, match="fewer children per node"):
        DRAFTER.check_tree(fan(5, 2), CONFIG.vocab_size)
    with pytest.raises(TreeError, match="static tree"):
        DRAFTER.check_tree(dynamic_tree(), CONFIG.vocab_size)


def test_cli_generate_draft_prompt_lookup_and_the_demo_method(capsys):
    from amphista_jax.cli import build_parser, main

    assert main(["generate", "--prompt", "x = 1\ny = 2\nx = 1\n", "--max-new-tokens", "8", "--draft",
                 "prompt_lookup"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("x = 1\ny = 2\nx = 1\n") and "tau = " in err and "untrained" not in err
    assert "note: auto: " in err  # `--tree auto`: chosen on this machine from its shipped acceptance statistics
    assert build_parser().parse_args(["demo", "--method", "prompt_lookup"]).method == "prompt_lookup"


def test_eval_specs_name_it_plainly_with_its_paper_tree(target):
    from amphista_jax.evals.methods import resolve_methods

    methods = resolve_methods(("prompt_lookup", "pl=prompt_lookup@chain-2#max_ngram=2", "prompt_lookup:untrained"),
                              "auto", target.config)
    assert [m.label for m in methods] == ["ar", "prompt_lookup", "pl", "prompt_lookup-untrained"]
    assert [m.tree for m in methods[1:]] == [chain(4), chain(2), chain(4)]
    gen = methods[1].generator(Generator.load(LoadedTarget.from_params(target.config, target.params)))
    assert methods[2].drafter == PromptLookup(max_ngram=2) and gen.draft_params == {}


def test_train_refuses_it_in_one_line(tmp_path):
    from amphista_jax.infra.config_io import ConfigFileError, load_config
    from amphista_jax.train.config import TrainConfig

    (tmp_path / "job.yaml").write_text("drafter: {type: prompt_lookup}\ndata: {kind: text, train: x}\n")
    with pytest.raises(ConfigFileError, match="nothing to train"):
        load_config(TrainConfig, tmp_path / "job.yaml")


def test_an_eval_run_with_a_plain_prompt_lookup_spec(tmp_path):
    import json

    from amphista_jax.cli import main
    from tests.helpers import ROOT

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "twice", "category": "code", "prompt": "x = 1\ny = 2\nx = 1\n"}) + "\n")
    out = tmp_path / "out"
    assert main(["eval", "--config", str(ROOT / "configs/eval/humaneval-code.yaml"), "--methods", "ar",
                 "prompt_lookup", "--set", "dataset.kind=jsonl", "--set", f"dataset.path={prompts}", "--set",
                 "dataset.limit=0", "--set", "max_new_tokens=8", "--set", f"out_dir={out}", "--set",
                 "heldout_batches=1"]) == 0  # no per-head accuracy asked of a method without heads
    assert "| prompt_lookup | auto: " in (out / "report.md").read_text()  # chosen on this machine
