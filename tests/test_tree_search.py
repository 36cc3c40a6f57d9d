"""Tree search: greedy growth is optimal under its model, the pick maximises tokens/s, its policy files resolve by
batch, and `auto` without acceptance statistics is the paper's tree."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from amphista_jax.assets import default_model_dir, shipped_heads_dir
from amphista_jax.drafters.io import read_draft_meta
from amphista_jax.tree_search import acceptance_rates, grow_trees, pick, tree_policy
from amphista_jax.trees.growth import dynamic_tree
from amphista_jax.trees.names import (
    PAPER_TREE,
    PRESETS,
    TreePolicy,
    get_tree,
    resolve_tree,
    searched_tree_path,
)
from amphista_jax.trees.tree import TreeError, TreeSpec, efficient_tree


def _expected_tau(choices, rates) -> float:
    return 1.0 + sum(np.prod([rates[d, r] for d, r in enumerate(path)]) for path in choices)


def _all_trees(depth: int, ranks: int, size: int):
    """Every prefix-closed tree of `size` draft nodes over `depth` x `ranks` (brute force)."""
    nodes = [p for d in range(1, depth + 1) for p in itertools.product(range(ranks), repeat=d)]
    for combo in itertools.combinations(nodes, size):
        chosen = set(combo)
        if all(p[:-1] in chosen for p in combo if len(p) > 1):
            yield combo


@pytest.mark.parametrize("seed", range(4))
def test_greedy_growth_is_optimal_for_every_size(seed):
    rng = np.random.default_rng(seed)
    rates = rng.uniform(0.05, 0.9, (3, 2)) * rng.uniform(0.3, 1, (3, 1))  # [D=3, R=2], ranks in any order
    grown = grow_trees(rates, max_nodes=9)
    assert [t.num_nodes - 1 for t, _ in grown] == list(range(1, 10))
    for size, (tree, tau) in enumerate(grown, start=1):
        best = max(_expected_tau(c, rates) for c in _all_trees(3, 2, size))
        assert tau == pytest.approx(_expected_tau(tree.choices, rates)) == pytest.approx(best)
        assert all(p[:-1] in set(tree.choices) for p in tree.choices if len(p) > 1)  # prefix-closed
        assert tree.depth <= 3 and max(max(p) for p in tree.choices) < 2


def test_growth_follows_path_probability_and_stops_at_zero():
    rates = np.array([[0.6, 0.2, 0.0], [0.5, 0.0, 0.0]])
    grown = grow_trees(rates, max_nodes=10)
    assert [t.choices for t, _ in grown][-1] == ((0,), (1,), (0, 0), (1, 0))
    assert [round(tau, 3) for _, tau in grown] == [1.6, 1.9, 2.1, 2.2]  # +0.6, +0.3 (0,0), +0.2 (1,), +0.1 (1,0)
    with pytest.raises(ValueError, match="probabilities"):
        grow_trees(np.array([[1.5]]), 3)


def test_pick_maximises_expected_tokens_per_second():
    sizes, taus = (1, 2, 4, 8), (1.5, 1.9, 2.3, 2.6)
    steps = (1.1, 1.2, 1.3, 2.0)  # tokens/s: 1.36, 1.58, 1.77, 1.30 -> size 4
    result = pick(sizes, taus, steps, ar_step_seconds=1.0)
    assert result.sizes[result.best] == 4
    assert result.speedups[result.best] == pytest.approx(2.3 / 1.3)
    slow = pick(sizes, taus, tuple(s * 3 for s in steps), ar_step_seconds=1.0)
    assert max(slow.speedups) < 1  # nothing beats AR: the caller must say so


def test_acceptance_rates():
    assert acceptance_rates(np.array([[4, 0]]), np.array([[1, 0]])).tolist() == [[0.25, 0.0]]


def test_tree_auto_without_acceptance_statistics_is_the_paper_tree(tmp_path, capsys):
    """Heads without acceptance statistics: `auto` is their paper's tree, with a note for the front-end to print
    (the library prints nothing); a tree tree search wrote is used only when named."""
    tree, note = resolve_tree("auto", tmp_path)
    assert tree == PRESETS[PAPER_TREE] and "calibrate --acceptance --heads" in note
    assert note.endswith(f"; using {PAPER_TREE}")
    assert resolve_tree("auto", None) == (  # untrained heads
        PRESETS[PAPER_TREE], f"tree auto: no acceptance statistics ship for these heads here; using {PAPER_TREE}")
    assert get_tree("auto") == get_tree("auto", tmp_path) == PRESETS[PAPER_TREE]
    for method, paper_tree in (("bita", efficient_tree(3, 5)), ("eagle", dynamic_tree())):  # their papers' trees
        heads = tmp_path / method
        heads.mkdir()
        shutil.copy(shipped_heads_dir(method) / "draft.json", heads)
        paper = read_draft_meta(heads).drafter.paper_tree
        assert resolve_tree("auto", heads, paper)[0] == get_tree("auto", heads, paper) == paper_tree
    assert capsys.readouterr().err == ""
    path = searched_tree_path(tmp_path)
    path.parent.mkdir()
    path.write_text(json.dumps([[0], [0, 0], [1]]))
    assert resolve_tree("auto", tmp_path)[0] == PRESETS[PAPER_TREE]
    assert resolve_tree(str(path), tmp_path) == (TreeSpec(((0,), (1,), (0, 0))), None)


def test_tree_policy_picks_by_batch_and_says_no_speculation(tmp_path):
    """Tree search stores one tree per batch size (none where every tree is predicted slower than AR, from
    synthetic costs); its policy file resolves by the batch at hand: the largest measured batch size at or below
    it."""
    sizes, taus = (1, 2, 4), (1.6, 2.0, 2.3)
    trees = [TreeSpec(((0,),)), TreeSpec(((0,), (1,))), TreeSpec(((0,), (1,), (0, 0)))]
    results = {1: pick(sizes, taus, (1.1, 1.2, 1.3), 1.0),  # 1.45, 1.67, 1.77 tokens/step-s: 4 nodes
               4: pick(sizes, taus, (1.2, 1.9, 2.6), 1.0),  # 1.33, 1.05, 0.88: 1 node
               16: pick(sizes, taus, (1.7, 2.5, 3.4), 1.0)}  # 0.94, 0.8, 0.68: AR wins
    policy = tree_policy(results, trees)
    assert policy.by_batch == ((1, trees[2]), (4, trees[0]), (16, None))
    assert [policy.at(b) for b in (1, 2, 3, 4, 8, 15, 16, 64)] == [trees[2]] * 3 + [trees[0]] * 3 + [None] * 2
    path = tmp_path / "t.batch.json"
    path.write_text(json.dumps(policy.to_json()))
    assert TreePolicy.read(path) == policy
    assert resolve_tree(str(path), batch=2) == (trees[2], None)
    assert resolve_tree(str(path), batch=4) == (trees[0], None)
    tree, note = resolve_tree(str(path), batch=32)
    assert tree is None and "no speculation at batch 32" in note
    path.write_text('{"batch_sizes": {"1": 3}}')
    with pytest.raises(TreeError, match="tree-search --replace"):
        resolve_tree(str(path))
    with pytest.raises(TreeError, match="distinct ascending"):
        TreePolicy(((2, None), (1, None)))


def test_generator_and_eval_follow_a_policy_file_by_batch(tmp_path):
    """Under a tree policy file the Generator drafts on the batch's tree and decodes autoregressively where the
    policy says no speculation (same tokens, tau 1, said in `Generation.tree`); the evaluation's method resolves
    the same way."""
    from amphista_jax import Generator
    from amphista_jax.evals.methods import resolve_method

    heads = tmp_path / "medusa"
    shutil.copytree(shipped_heads_dir("medusa"), heads)
    path = str(tmp_path / "medusa.batch.json")
    Path(path).write_text(json.dumps(TreePolicy(((1, PRESETS["small-8"]), (2, None))).to_json()))
    gen = Generator.load(heads=heads, tree=path)
    assert gen.tree == PRESETS["small-8"] and any("batch 2: no speculation" in n for n in gen.notes)
    prompts = ["def add(a, b):", "import os\n"]
    one, two = gen.generate(prompts[0], max_new_tokens=12), gen.generate(prompts, max_new_tokens=12)
    assert one.tree == path and two.tree == f"{path}: no speculation at batch 2" and two.tau == [1.0, 1.0]
    ar = gen.autoregressive().generate(prompts[0], max_new_tokens=12)
    assert two.token_ids[0] == one.token_ids[0] == ar.token_ids[0]
    assert gen.for_batch(3).tree is gen.for_batch(2).tree is None and gen.for_batch(1) is gen  # batch 3: as 2
    assert gen.for_batch(2).target is gen.target  # one program cache for every batch size's view
    assert "".join(gen.stream(prompts[0], max_new_tokens=12)) == one.texts[0]
    assert resolve_method(f"{heads}@{path}", "auto", batch=1).tree == PRESETS["small-8"]
    at_two = resolve_method(f"m={heads}@{path}", "auto", batch=2)
    assert at_two.drafter is None and at_two.label == "m" and "none at batch 2" in at_two.tree_name


def test_search_grows_static_trees_for_heads_that_draft_to_any_depth(tmp_path, monkeypatch):
    """EAGLE drafts to any depth: the search calibrates to `depth`, grows and times static trees no deeper (offering
    to release compiled programs after each, against the memory-mapping limit), and `auto` then decodes on the
    searched tree with AR's tokens. Heads of a fixed depth refuse a deeper search."""
    from amphista_jax import Generator
    from amphista_jax.choice import step_clock
    from amphista_jax.prompts import humaneval_prompts
    from amphista_jax.tree_search import TreeSearchError, search

    releases = []
    monkeypatch.setattr(step_clock, "release_if_crowded", lambda: releases.append(1) or False)

    heads = tmp_path / "eagle"
    shutil.copytree(shipped_heads_dir("eagle"), heads)
    out = searched_tree_path(heads)
    results, policy = search(default_model_dir(), heads, humaneval_prompts(100, 102), out, max_nodes=4, ranks=2,
                             max_new_tokens=32, runs=3, sizes=(2, 4), batch_sizes=(1,), depth=2)
    picked = TreeSpec(tuple(tuple(p) for p in json.loads(out.read_text())))
    assert picked.depth <= 2 and 1 <= len(picked.choices) <= 4 and policy.by_batch[0][0] == 1
    report = json.loads(out.with_suffix(".report.json").read_text())
    assert np.asarray(report["rates"]).shape == (2, 2) and report["calibration_tree_nodes"] == 4
    assert len(releases) == len(report["trees"]) >= 2  # one offer per tree timed
    gen = Generator.load(heads=heads, tree=str(out.with_suffix(".batch.json")))
    at_one = gen.for_batch(1).tree  # the searched tree, or AR where none was predicted to win (timings decide)
    assert (at_one is None) == (policy.at(1) is None) and (at_one is None or set(at_one.choices) == set(picked.choices))
    prompt = humaneval_prompts(100, 101)[0]
    assert gen.generate(prompt, max_new_tokens=12).token_ids == gen.autoregressive().generate(
        prompt, max_new_tokens=12).token_ids
    with pytest.raises(TreeSearchError, match="--depth 9: the medusa heads draft 4 tokens deep at most"):
        search(default_model_dir(), shipped_heads_dir("medusa"), ["x"], tmp_path / "m.json", depth=9)


@pytest.mark.slow
def test_search_by_method_for_prompt_lookup_and_its_policy_file(tmp_path):
    """A method with nothing to train is searched by name (`--method prompt_lookup`): the calibration tree ranks its
    branches (4), a continuation has one next token (every non-first child below depth 1 is never accepted), and
    the tree per batch size it writes beside `--out` (`<stem>.batch.json`) is a tree name that resolves by batch,
    for `resolve_tree`, eval specs and the Generator, which then decodes AR's tokens. Under -m slow:
    test_search_grows_static_trees_for_heads_that_draft_to_any_depth runs the same search end to end (calibrate,
    grow, time, write the tree and its policy, decode AR's tokens on it), and
    test_generator_and_eval_follow_a_policy_file_by_batch and test_tree_policy_picks_by_batch_and_says_no_speculation
    resolve a per-batch policy for the Generator and eval specs."""
    from amphista_jax import Generator
    from amphista_jax.evals.methods import resolve_method
    from amphista_jax.prompts import humaneval_prompts
    from amphista_jax.tree_search import search

    out = tmp_path / "pl.json"
    # 64 new tokens: at 32 a decode timed on a loaded machine could take no longer than its prefill (TreeSearchError)
    _, policy = search(default_model_dir(), "prompt_lookup", humaneval_prompts(100, 102), out, max_nodes=4,
                       max_new_tokens=64, runs=1, sizes=(2,), batch_sizes=(1, 2), depth=3)
    report = json.loads(out.with_suffix(".report.json").read_text())
    rates = np.asarray(report["rates"])
    assert rates.shape == (3, 4) and report["calibration_tree_nodes"] == 12 and report["heads"] == "prompt_lookup"
    assert (rates[1:, 1:] == 0).all() and rates[0, 0] > 0
    file = str(out.with_suffix(".batch.json"))
    assert TreePolicy.read(file) == policy
    for b in (1, 2, 5):
        tree, note = resolve_tree(file, batch=b)
        assert tree == policy.at(b) and (note is None) == (tree is not None)
        method = resolve_method(f"prompt_lookup@{file}", "auto", batch=b)
        assert (method.drafter is None) == (tree is None) and (tree is None or method.tree == tree)
    with pytest.raises(TreeError, match="tree per batch size"):
        get_tree(file)
    gen = Generator.load(heads="prompt_lookup", tree=file)
    assert any(f"tree {file}: batch 1: " in n for n in gen.notes)
    prompt = humaneval_prompts(100, 101)[0]
    assert gen.generate(prompt, max_new_tokens=12).token_ids == gen.autoregressive().generate(
        prompt, max_new_tokens=12).token_ids


def test_ar_step_is_timed_before_and_after_the_trees_and_the_faster_kept(monkeypatch):
    """A machine that drifts during a search must not price every tree against one early AR timing: AR is timed first
    and last, and the faster of the two is the search's AR step."""
    from amphista_jax import tree_search

    ar_times = iter([0.058, 0.041])  # slow at the start, as in round 14's searches
    order = []
    monkeypatch.setattr(tree_search.StepClock, "for_trees", classmethod(lambda cls, *a, **k: cls(
        np.zeros((1, 1)), np.ones(1), 8, 4, 1)))
    monkeypatch.setattr(tree_search.StepClock, "ar_step_seconds",
                        lambda self, gen: order.append("ar") or next(ar_times))
    monkeypatch.setattr(tree_search.StepClock, "spec_step_seconds",
                        lambda self, gen, trees, progress=None: order.append("trees") or [0.05] * len(trees))
    gen = type("Gen", (), {"autoregressive": lambda self: self})()
    ar, steps = tree_search.measure_step_seconds(gen, [1], [TreeSpec(((0,),))], 4)
    assert order == ["ar", "trees", "ar"]
    assert (ar, steps) == (0.041, [0.05])
