"""`amphista-jax recipe` on the embedded model: a few answers regenerated, two head sets trained a few steps, shipped in
bfloat16 with acceptance statistics, a report; resumed after a kill at each stage without redoing what finished;
its plan refusing a budget too small for any method in one line; the accelerator's recipe resolves every method."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from amphista_jax import recipe
from amphista_jax.infra.config_io import load_config
from amphista_jax.recipe import RecipeConfig, RecipeError, plan_stages, run_recipe, train_config
from tests.helpers import ROOT

TINY = ROOT / "configs/recipe/tiny.yaml"


class Killed(BaseException):
    """A kill at a stage (not an Exception: nothing may catch it on the way out)."""


def killer(fn, on_call: int, calls: list):
    """`fn`, killed at its `on_call`-th call (1-based); every call is counted in `calls`."""
    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == on_call:
            raise Killed(fn.__name__)
        return fn(*args, **kwargs)
    return wrapped


@pytest.fixture
def tiny_recipe(tmp_path):
    return load_config(RecipeConfig, TINY, [f"out_dir={tmp_path / 'out'}", "regenerate.count=12",
                                           "regenerate.max_new_tokens=8"])


def test_the_recipe_runs_end_to_end_and_resumes_after_a_kill_at_each_stage(tiny_recipe, monkeypatch):
    """Probes and plan, then killed in regeneration, in the first training and in the second shipping; each rerun
    does only what is left; the shipped heads decode as AR does."""
    import amphista_jax.train.distill as distill_module
    import amphista_jax.train.heads as heads_module
    from amphista_jax import Generator

    out = Path(tiny_recipe.out_dir)
    distills, trains, ships = [], [], []
    real_distill, real_train, real_ship = distill_module.distill, heads_module.train_heads, recipe.ship
    # the first run: probes (a distill and a train per method), the plan, then killed in regeneration
    monkeypatch.setattr(distill_module, "distill", killer(real_distill, 2, distills))
    with pytest.raises(Killed):
        run_recipe(tiny_recipe, TINY)
    plan = json.loads((out / "plan.json").read_text())
    assert [s["name"] for s in plan["stages"]] == ["regenerate", "train:medusa", "ship:medusa", "train:hydra",
                                                   "ship:hydra"]
    assert all(s["planned"] for s in plan["stages"]) and not (out / "stages").exists()
    assert plan["probes"]["regenerate"]["answers"] == 8  # its first batch: kept
    assert len(trains) == 0 and len(distills) == 2
    # killed in the first training: regeneration finished and is not redone
    monkeypatch.setattr(distill_module, "distill", killer(real_distill, 0, distills))
    monkeypatch.setattr(heads_module, "train_heads", killer(real_train, 1, trains))
    with pytest.raises(Killed):
        run_recipe(tiny_recipe, TINY)
    assert len(distills) == 3 and (out / "stages/regenerate.json").is_file()
    assert sum(1 for _ in (out / "data/answers.jsonl").open()) == 12
    # killed shipping the second head set
    monkeypatch.setattr(heads_module, "train_heads", killer(real_train, 0, trains))
    monkeypatch.setattr(recipe, "ship", killer(real_ship, 2, ships))
    with pytest.raises(Killed):
        run_recipe(tiny_recipe, TINY)
    assert len(distills) == 3 and len(trains) == 3 and len(ships) == 2
    # the last run finishes what is left, nothing more
    report = run_recipe(tiny_recipe, TINY)
    assert len(distills) == 3 and len(trains) == 3 and len(ships) == 3
    results = {s["name"]: s["result"] for s in report["stages"]}
    assert results["regenerate"]["answers"] == 12 and results["train:medusa"]["steps"] == 4
    assert results["train:hydra"]["tokens"] == 4 * 2 * 128 and not report["files_over_limit"]
    for method in ("medusa", "hydra"):
        assert results[f"ship:{method}"]["best_tau"] >= 1.0
        assert (out / "heads" / method / "acceptance.json").is_file()
    assert "| ship:hydra | yes |" in (out / "report.md").read_text()
    shipped = Generator.load(heads=out / "heads" / "medusa", tree="chain-2")
    assert shipped.generate("def add(a, b):", max_new_tokens=12).token_ids == \
        shipped.autoregressive().generate("def add(a, b):", max_new_tokens=12).token_ids


def test_a_budget_too_small_for_any_method_is_refused_in_one_line():
    cfg = load_config(RecipeConfig, TINY, ["budget_s=20"])
    probes = {"regenerate": {"answers": 8, "seconds": 4.0},
              "train:medusa": {"fixed_s": 15.0, "step_s": 1.0}, "ship:medusa": {"batch_s": 3.0},
              "train:hydra": {"fixed_s": 12.0, "step_s": 2.0}, "ship:hydra": {"batch_s": 3.0}}
    with pytest.raises(RecipeError) as e:
        plan_stages(cfg, probes, TINY.parent, spent_s=5.0)
    assert "\n" not in str(e.value) and "no method fits the 15 s left" in str(e.value)
    assert "cheapest, medusa, needs 19 s" in str(e.value) and "raise budget_s" in str(e.value)
    stages = plan_stages(load_config(RecipeConfig, TINY, ["budget_s=45"]), probes, TINY.parent, spent_s=5.0)
    assert [(s.name, s.planned) for s in stages] == [("regenerate", True), ("train:medusa", True),
                                                     ("ship:medusa", True), ("train:hydra", False),
                                                     ("ship:hydra", False)]
    assert stages[1].work == 4 and stages[3].why == "needs 23 s with 18 s left: skipped"
    assert stages[0].work == 16  # the rest of the 24 answers: 18 s left at 0.5 s an answer


def test_the_accelerator_recipe_resolves_every_method_with_its_token_budget():
    path = ROOT / "configs/recipe/smollm2-h200.yaml"
    cfg = load_config(RecipeConfig, path)
    steps = {m: train_config(cfg, m, path.parent).loop.steps for m in cfg.methods}
    assert steps["eagle3"] == steps["dflash"] == 16 * 600 and steps["medusa"] == 4 * 600 and steps["bita"] == 480
    assert set(cfg.methods) == {"eagle3", "dflash", "medusa", "amphista", "hydra++", "sar", "eagle", "bita"}
    assert train_config(cfg, "dflash", path.parent).drafter.num_layers == 5
