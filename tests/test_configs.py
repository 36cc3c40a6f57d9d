"""Every YAML under configs/ parses into its dataclass; bad keys and values are clear errors; a `drafter:` mapping
builds the registered drafter its `type` names; each declared range is checked by the one checker."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from amphista_jax.drafters import (
    DRAFTERS,
    Amphista,
    BiTA,
    DFlash,
    DraftModel,
    Eagle,
    Eagle3,
    Gumiho,
    Hydra,
    Medusa,
    PromptLookup,
)
from amphista_jax.drafters import SemiAutoregressive as SAR
from amphista_jax.evals.config import EvalConfig
from amphista_jax.infra.config_io import ConfigFileError, load_config, to_dict
from amphista_jax.infra.ranges import RANGE
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.recipe import RecipeConfig
from amphista_jax.train.config import DataConfig, LossConfig, MeshConfig, TrainConfig, load_train_config
from amphista_jax.train.loop import LoopConfig
from amphista_jax.train.optim import OptimConfig
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
        assert cfg.drafter.name == kind and kind in DRAFTERS
    assert f"--config configs/{path.relative_to(CONFIGS)}" in path.read_text()  # header shows its run command


def test_every_base_is_used_and_bases_merge_under_the_file(tmp_path):
    used = {(p.parent / b).resolve() for p in LAUNCHABLE
            for b in (lambda b: [b] if isinstance(b, str) else b or [])(read_yaml_raw(p).get("base"))}
    assert used == {p.resolve() for p in BASES.glob("*.yaml")}
    (tmp_path / "pod.yaml").write_text("mesh: {data: 1, fsdp: 4, tensor: 2}\ndata: {batch_size: 64, max_len: 9}\n")
    (tmp_path / "recipe.yaml").write_text("drafter: {type: hydra, num_heads: 3, num_layers: 2}\n"
                                          "data: {kind: text, train: x, batch_size: 32}\n")
    (tmp_path / "job.yaml").write_text("base: [recipe.yaml, pod.yaml]\ndata: {microbatches: 4}\n"
                                       "drafter: {num_layers: 4}\n")
    cfg = load_config(TrainConfig, tmp_path / "job.yaml", ["data.max_len=16", "drafter.lm_weight=0.5"])
    assert (cfg.drafter, cfg.mesh.fsdp, cfg.data.kind, cfg.data.batch_size, cfg.data.microbatches,
            cfg.data.max_len) == (Hydra(num_heads=3, num_layers=4, lm_weight=0.5), 4, "text", 64, 4, 16)
    # later bases win, the file wins, then --set; a base's drafter: mapping merges key by key under the file's
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


def test_drafter_settings_are_checked_against_the_drafter():
    path = CONFIGS / "amphista" / "code.yaml"
    cfg = load_config(TrainConfig, path, ["drafter.auto_embedding=false"])
    assert cfg.drafter.auto_embedding is False and cfg.drafter.name == "amphista"
    with pytest.raises(ConfigFileError, match=r"drafter: unknown key\(s\) \['auto_embeding'\]; valid keys: .*"
                                              r"'auto_embedding'"):
        load_config(TrainConfig, path, ["drafter.auto_embeding=false"])
    with pytest.raises(ConfigFileError, match="adaptation_stages=9 must be an integer in"):
        load_config(TrainConfig, path, ["drafter.adaptation_stages=9"])
    with pytest.raises(ConfigFileError, match="adaptation_stages=4 must be in .*num_heads=3"):
        load_config(TrainConfig, path, ["drafter.adaptation_stages=4", "drafter.num_heads=3"])
    with pytest.raises(ConfigFileError, match="drafter.type 'eagle-3' is not one of amphista, bita, .*, sar$"):
        load_config(TrainConfig, path, ["drafter.type=eagle-3"])
    # `type` names a registered class, not a preset of one (`VARIANTS`' hydra++ is Hydra's settings, written out)
    with pytest.raises(ConfigFileError, match="drafter.type 'hydra\\+\\+' is not one of"):
        load_config(TrainConfig, path, ["drafter={type: hydra++}"])


# A trainable registered drafter with settings other than its defaults, as Python builds it.
NON_DEFAULT = {
    "amphista": Amphista(num_heads=3, adaptation_stages=3, auto_embedding=False, lm_head_rank=8, lambda_lm=0.5),
    "bita": BiTA(num_masks=4, num_prompt=0, prompt_dropout=0.2, remat=False),
    "dflash": DFlash(block_size=8, num_layers=2, target_layer_ids=(1, 3), loss_gamma=4.0, draft_vocab=(2, 4)),
    "draft_model": DraftModel(config=tiny_llama_config(num_layers=1), temperature=0.5, p_min=0.1, layers=1),
    "eagle": Eagle(feature_noise=0.0, input_norm=False, rope_theta=10000.0),
    "eagle3": Eagle3(feature_layers=(1, 2, 3), ttt_steps=3, lm_weight=0.5),
    "gumiho": Gumiho(mlp_heads=3, fta_nodes=0, mlp_weight=0.25, full_tree_attention=False),
    "hydra": Hydra.plus_plus(num_heads=3),
    "medusa": Medusa(num_heads=2, num_layers=0, shared_lm_head=True, draft_vocab=(1, 5, 9)),
    "sar": SAR(num_heads=2, encoder="lstm", width=16),
}
TRAINABLE = [name for name, cls in DRAFTERS.items() if cls.trainable]


def _plain(value):
    """`to_dict`'s output as YAML writes it (lists for tuples)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, tuple | list) else value


@pytest.mark.parametrize("name", TRAINABLE)
def test_a_drafter_mapping_builds_what_python_builds(name, tmp_path):
    """`drafter: {type: <name>, <settings>}` is `DRAFTERS[name](**settings)`: the same drafter as the Python
    settings class makes, every setting carried; `to_dict` writes it back as that mapping."""
    drafter = NON_DEFAULT[name]
    changed = {f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)
               if getattr(drafter, f.name) != f.default}
    assert len(changed) >= 2, changed  # a case that shows settings arriving, not defaults
    settings = {k: v for k, v in to_dict(drafter).items() if k in changed}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"data": {"train": "x"}, "drafter": _plain(
        {"type": name} | settings)}))
    cfg = load_train_config(tmp_path / "job.yaml")
    assert type(cfg.drafter) is type(drafter) and cfg.drafter == drafter
    assert cfg == TrainConfig(DataConfig(train="x"), drafter=drafter)
    assert to_dict(cfg)["drafter"] == {"type": name} | to_dict(drafter) and to_dict(cfg)["drafter"]["type"] == name
    back = load_train_config(None, [f"drafter={yaml.safe_dump(_plain(to_dict(drafter)), default_flow_style=True)}",
                                    "data.train=x"])
    assert back.drafter == drafter


@pytest.mark.parametrize("make, message", [
    (lambda: Medusa(num_heads=0), "num_heads=0 must be an integer >= 1"),
    (lambda: Medusa(loss_decay=1.5), "loss_decay=1.5 must be in (0, 1]"),
    (lambda: Medusa(num_heads=2.0), "num_heads=2.0 must be an integer >= 1"),
    (lambda: Eagle(feature_noise=-0.1), "feature_noise=-0.1 must be >= 0 (0 = no noise)"),
    (lambda: Eagle3(step_decay=float("nan")), "step_decay=nan must be in (0, 1]"),
    (lambda: BiTA(prompt_dropout=1.0), "prompt_dropout=1.0 must be in [0, 1)"),
    (lambda: DFlash(block_size=True), "block_size=True must be an integer >= 2 (the root and at least one draft "
                                      "slot)"),
    (lambda: SAR(width=0), "width=0 must be an integer >= 1 (or None for H/4)"),
    (lambda: PromptLookup(branches=0), "branches=0 must be an integer >= 1 (1: chains only)"),
    (lambda: DraftModel(p_min="0.1"), "p_min='0.1' must be a number in [0, 1) (0 = draft every node of the tree)"),
    (lambda: DataConfig(train="x", max_len=1), "data.max_len=1 must be an integer >= 2 (a token and the next one to "
                                               "predict)"),
    (lambda: DataConfig(train="x", heldout_fraction=1), "data.heldout_fraction=1 must be in (0, 1)"),
    (lambda: LossConfig(top_k=0), "loss.top_k=0 must be an integer >= 1"),
    (lambda: MeshConfig(tensor=0), "tensor=0 must be an integer >= 1"),
    (lambda: OptimConfig(clip_norm=0), "clip_norm=0 must be > 0 (the global gradient norm is clipped to it)"),
    (lambda: LoopConfig(eval_every=-1), "eval_every=-1 must be an integer >= 0 (0 = only at the end)"),
    (lambda: TrainConfig(DataConfig(train="x"), eval_batches=0), "eval_batches=0 must be an integer >= 1"),
    (lambda: TrainConfig(DataConfig(train="x"), draft_vocab_size=-4), "draft_vocab_size=-4 must be an integer >= 0 "
                                                                      "(0 = the whole vocabulary)"),
])
def test_a_value_outside_its_declared_range_is_one_line(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value) == message


RANGED = [(cls, f) for cls in [*DRAFTERS.values(), DataConfig, LossConfig, MeshConfig, OptimConfig, LoopConfig,
                               TrainConfig] for f in dataclasses.fields(cls) if RANGE in f.metadata]


@pytest.mark.parametrize("cls, field", RANGED, ids=lambda x: getattr(x, "__name__", getattr(x, "name", "")))
def test_every_declared_bound_is_checked(cls, field):
    """Just past each declared bound (and a bool for a count), construction stops at that field; each default is
    in its range."""
    rng, base = field.metadata[RANGE], {"train": "x"} if cls is DataConfig else {}
    data = (DataConfig(train="x"),) if cls is TrainConfig else ()
    past = [rng.ge - 1 if rng.ge is not None else None, rng.gt, rng.le + 1 if rng.le is not None else None, rng.lt]
    hint = typing.get_type_hints(cls)[field.name]
    for value in [v for v in past if v is not None] + ([True] if int in (hint, *typing.get_args(hint)) else []):
        with pytest.raises(ValueError, match=rf"^(data\.|loss\.)?{field.name}={value!r} must be "):
            cls(*data, **base | {field.name: value})
    assert rng.holds(field.default) if field.default is not None else True


def test_yaml_values_outside_their_ranges_name_the_file_and_section(tmp_path):
    (tmp_path / "job.yaml").write_text("data: {train: x}\ndrafter: {type: eagle3, ttt_steps: 0}\n")
    with pytest.raises(ConfigFileError) as e:
        load_train_config(tmp_path / "job.yaml")
    assert str(e.value) == (f"{tmp_path / 'job.yaml'}: drafter: ttt_steps=0 must be an integer >= 1 (1 = no "
                            "unrolling: plain teacher forcing)")
    with pytest.raises(ConfigFileError, match=r"job.yaml: loop: keep_checkpoints=0 must be an integer >= 1 \(a run"):
        load_train_config(tmp_path / "job.yaml", ["drafter.ttt_steps=2", "loop.keep_checkpoints=0"])


def test_eval_config_overrides_and_errors():
    path = CONFIGS / "eval" / "humaneval-code.yaml"
    cfg = load_config(EvalConfig, path, ["methods=[ar, 'medusa:untrained@chain-4']", "dataset.limit=3"])
    assert cfg.methods == ("ar", "medusa:untrained@chain-4") and cfg.dataset.limit == 3
    assert (cfg.dataset.kind, cfg.tree, cfg.max_new_tokens, cfg.temperature) == ("humaneval", "auto", 128, 0.0)
    with pytest.raises(ConfigFileError, match="dataset.kind 'mtbench' must be one of"):
        load_config(EvalConfig, path, ["dataset.kind=mtbench"])
    with pytest.raises(ConfigFileError, match="greedy acceptance needs temperature 0"):
        load_config(EvalConfig, path, ["acceptance=greedy", "temperature=0.7"])
