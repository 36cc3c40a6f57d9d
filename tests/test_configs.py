"""Every YAML under configs/ parses into its dataclass; bad keys and values are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from amphista_jax.drafters import DRAFTERS
from amphista_jax.evals.runner import EvalConfig
from amphista_jax.infra.config_io import ConfigFileError, load_config
from amphista_jax.recipe import RecipeConfig
from amphista_jax.train.config import TrainConfig
from amphista_jax.train.pretrain_target import PretrainConfig

CONFIGS = Path(__file__).parents[1] / "configs"
BASES = CONFIGS / "base"  # fragments (pods, method recipes) that configs merge with `base:`
LAUNCHABLE = sorted(p for p in CONFIGS.rglob("*.yaml") if BASES not in p.parents)


@pytest.mark.parametrize("path", LAUNCHABLE, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_config_file_parses(path):
    kind = path.relative_to(CONFIGS).parts[0]  # "target", "eval", "recipe", or a method's directory
    cls = {"target": PretrainConfig, "eval": EvalConfig, "recipe": RecipeConfig}.get(kind, TrainConfig)
    cfg = load_config(cls, path)
    assert isinstance(cfg, cls)
    if cls is EvalConfig:
        assert cfg.methods[0] == "ar" and len(cfg.methods) >= 2
    if cls is TrainConfig:
        assert cfg.method == kind and kind in DRAFTERS
    assert f"--config configs/{path.relative_to(CONFIGS)}" in path.read_text()  # header shows its run command


def test_every_base_is_used_and_bases_merge_under_the_file(tmp_path):
    used = {(p.parent / b).resolve() for p in LAUNCHABLE
            for b in (lambda b: [b] if isinstance(b, str) else b or [])(read_yaml_raw(p).get("base"))}
    assert used == {p.resolve() for p in BASES.glob("*.yaml")}
    (tmp_path / "pod.yaml").write_text("mesh: {data: 1, fsdp: 4, tensor: 2}\ndata: {batch_size: 64, max_len: 9}\n")
    (tmp_path / "recipe.yaml").write_text("method: hydra\ndata: {kind: text, train: x, batch_size: 32}\n")
    (tmp_path / "job.yaml").write_text("base: [recipe.yaml, pod.yaml]\ndata: {microbatches: 4}\n")
    cfg = load_config(TrainConfig, tmp_path / "job.yaml", ["data.max_len=16"])
    assert (cfg.method, cfg.mesh.fsdp, cfg.data.kind, cfg.data.batch_size, cfg.data.microbatches,
            cfg.data.max_len) == ("hydra", 4, "text", 64, 4, 16)  # later bases win, the file wins, then --set
    (tmp_path / "loop.yaml").write_text("base: job2.yaml\n")
    (tmp_path / "job2.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigFileError, match="its bases include itself"):
        load_config(TrainConfig, tmp_path / "loop.yaml")
    for bad in ("3", "[{x: 1}]"):
        (tmp_path / "odd.yaml").write_text(f"base: {bad}\n")
        with pytest.raises(ConfigFileError, match="base must be a file name or a list of them"):
            load_config(TrainConfig, tmp_path / "odd.yaml")
    (tmp_path / "lost.yaml").write_text("base: nope.yaml\n")
    with pytest.raises(ConfigFileError, match="does not exist \\(a base of"):
        load_config(TrainConfig, tmp_path / "lost.yaml")


def read_yaml_raw(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def test_overrides_and_errors():
    path = CONFIGS / "target" / "tiny-code.yaml"
    cfg = load_config(PretrainConfig, path, ["steps=7", "arch.num_layers=3", "optim.lr=1e-4"])
    assert (cfg.steps, cfg.arch.num_layers, cfg.optim.lr) == (7, 3, 1e-4)
    with pytest.raises(ConfigFileError, match=r"unknown key\(s\) \['stepz'\]"):
        load_config(PretrainConfig, path, ["stepz=7"])
    with pytest.raises(ConfigFileError, match="arch.num_layers: expected int"):
        load_config(PretrainConfig, path, ["arch.num_layers=three"])
    with pytest.raises(ConfigFileError, match="must look like key=value"):
        load_config(PretrainConfig, path, ["steps"])
    with pytest.raises(ConfigFileError, match="does not exist"):
        load_config(PretrainConfig, "configs/nope.yaml")


def test_method_settings_are_checked_against_the_method():
    path = CONFIGS / "amphista" / "code.yaml"
    cfg = load_config(TrainConfig, path, ["method_settings.auto_embedding=false"])
    assert cfg.method_settings["auto_embedding"] is False
    with pytest.raises(ValueError, match=r"\['auto_embeding'\] are not amphista settings"):
        load_config(TrainConfig, path, ["method_settings.auto_embeding=false"])
    with pytest.raises(ValueError, match="adaptation_stages"):
        load_config(TrainConfig, path, ["method_settings.adaptation_stages=9"])


def test_eval_config_overrides_and_errors():
    path = CONFIGS / "eval" / "humaneval-code.yaml"
    cfg = load_config(EvalConfig, path, ["methods=[ar, 'medusa:untrained@chain-4']", "dataset.limit=3"])
    assert cfg.methods == ("ar", "medusa:untrained@chain-4") and cfg.dataset.limit == 3
    assert (cfg.dataset.kind, cfg.tree, cfg.max_new_tokens, cfg.temperature) == ("humaneval", "auto", 128, 0.0)
    with pytest.raises(ConfigFileError, match="dataset.kind 'mtbench' must be one of"):
        load_config(EvalConfig, path, ["dataset.kind=mtbench"])
    with pytest.raises(ConfigFileError, match="greedy acceptance needs temperature 0"):
        load_config(EvalConfig, path, ["acceptance=greedy", "temperature=0.7"])
