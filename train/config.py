"""The train config: data, mesh and drafter of `amphista-jax train`, each checked when it is made.

The drafter is a registered `Drafter` with its settings, written `drafter: {type: medusa, num_heads: 4}` in YAML
(`infra.config_io` builds `DRAFTERS["medusa"](num_heads=4)`) and `TrainConfig(data, drafter=Medusa(num_heads=4))` in
Python; what only the trainer reads (`draft_vocab_size`) is a field of `TrainConfig`. Each field's simple range is
declared beside it (`infra.ranges.setting`); `__post_init__` checks them, then what relates fields to each other.
`load_train_config` refuses the form that came before (`method` + a `method_settings` mapping) in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from amphista_jax.drafters import DRAFTERS, Drafter, Medusa
from amphista_jax.drafters.draft_vocab import DraftVocab
from amphista_jax.infra.accelerators import get_accelerator
from amphista_jax.infra.config_io import ConfigFileError, load_config, read_yaml
from amphista_jax.infra.errors import UserError
from amphista_jax.infra.ranges import check_ranges, setting
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.hf import DTYPES
from amphista_jax.models.shapes import known_target
from amphista_jax.train.loop import LoopConfig
from amphista_jax.train.optim import OptimConfig

DATA_KINDS = ("text", "sharegpt", "stdlib")


class TrainConfigError(UserError, ValueError):
    """A train config that cannot work with its target, data, devices or out_dir: found before any slow work."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # "text": files (a directory or a glob), packed; "sharegpt": conversations JSON / JSONL; "stdlib": the
    # offline code corpus of an embedded target's pre-training (`train/corpus.py`), split by path hash exactly
    # as there, so the target's held-out files stay unseen (`train` / `heldout` are then ignored).
    kind: str = "text"
    train: str = ""
    heldout: str = ""  # "" = hold out `heldout_fraction` of the training examples
    heldout_fraction: float = setting(0.05, gt=0, lt=1)  # kind "stdlib" with a `corpus`: the recipe's own fraction
    # kind "stdlib": whose corpus: a target recipe YAML, or an exported target directory (its
    # training_summary.json); "" = the standard library alone
    corpus: str = ""
    max_len: int = setting(256, ge=2, why="a token and the next one to predict")
    batch_size: int = setting(8, ge=1)  # rows per step, over all processes (each process reads batch_size / processes)
    # Each step runs its batch as this many sequential slices and averages their gradients weighted by their loss
    # tokens (gradient accumulation, `train.step.over_microbatches`): the same batch and step count, with
    # 1/microbatches of the activation memory.
    microbatches: int = setting(1, ge=1)
    seed: int = 0
    cache_target_hidden: bool = False  # precompute the target's hidden states once (small targets)
    hidden_store: str = ""  # with cache_target_hidden: keep them in this directory for later runs ("": don't)
    # with hidden_store: the target layers whose inputs the store keeps, a superset of the method's captured layers
    # (`captured_layers`, as ids from 0), so that methods capturing different layers (EAGLE-3's, DFlash's) share
    # one target pass and one file; () = the method's own
    store_layers: tuple[int, ...] = ()
    # at most this many examples of each data file; a held-out split comes from them
    max_examples: int = setting(0, ge=0, why="0 = all")
    # > 0: the shuffled examples are taken this many batches at a time and sorted by length there, and each batch is
    # cut at its longest row (`data.length_grouped_dataset`): padding left out of the step's compute, one compiled
    # step per cut; 0: batches of random rows at data.max_len
    length_groups: int = setting(0, ge=0, why="0 = batches at data.max_len")

    def __post_init__(self) -> None:
        check_ranges(self, "data.")
        if self.kind not in DATA_KINDS:
            raise ValueError(f"data.kind {self.kind!r} must be one of {', '.join(DATA_KINDS)}")
        if not self.train and self.kind != "stdlib":
            raise ValueError("data.train is empty: set it to a conversations file, a directory or a glob")
        if self.batch_size % self.microbatches:
            raise ValueError(f"data.microbatches={self.microbatches} must be >= 1 and divide data.batch_size="
                             f"{self.batch_size}")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.store_layers) or len(
                set(self.store_layers)) != len(self.store_layers):
            raise ValueError(f"data.store_layers={list(self.store_layers)} must be distinct layer ids >= 0")


LABELS = ("data", "target")
LOSS_KINDS = ("ce", "kl")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What the heads learn. `labels: data`: the data's next tokens (hard labels); `labels: target`: the target's
    own greedy token at each position (its argmax), so the heads learn the target rather than the data's author.
    `kind: kl` (with `labels: target`): each head's LM term is the KL to the target's whole next-token
    distribution over the draft vocabulary. With `data.cache_target_hidden` the target's top `top_k` log-probs (the
    rest of the mass as one remainder) are stored beside its hidden states (the label store) and read from there."""

    labels: str = "data"
    kind: str = "ce"
    top_k: int = setting(32, ge=1)

    def __post_init__(self) -> None:
        check_ranges(self, "loss.")
        if self.labels not in LABELS:
            raise ValueError(f"loss.labels {self.labels!r} must be one of {', '.join(LABELS)}")
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"loss.kind {self.kind!r} must be one of {', '.join(LOSS_KINDS)}")
        if self.kind == "kl" and self.labels != "target":
            raise ValueError("loss.kind kl learns the target's distribution: set loss.labels to target")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = setting(1, ge=1)
    fsdp: int = setting(1, ge=1)
    tensor: int = setting(1, ge=1)

    def __post_init__(self) -> None:
        check_ranges(self)


DRAFT_VOCAB_SIZE = "draft_vocab_size"  # the trainer's setting (`TrainConfig.draft_vocab_size`), no drafter field
EXAMPLE = "configs/medusa/code.yaml"  # a config of the current form, named where an old one is refused


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data: DataConfig
    model: str = ""  # HF checkpoint directory; "" = the embedded default
    out_dir: str = "runs/heads"
    # the method and its settings: in YAML `drafter: {type: medusa, num_heads: 4, ...}` (`drafters.DRAFTERS`' names)
    drafter: Drafter = Medusa()
    # > 0: the heads draft over the `draft_vocab_size` most frequent label tokens of the training examples
    # (`train.examples.choose_draft_vocab`), for a drafter with a `draft_vocab` setting
    draft_vocab_size: int = setting(0, ge=0, why="0 = the whole vocabulary")
    optim: OptimConfig = OptimConfig(lr=1e-3, warmup_steps=50, b1=0.9, b2=0.999)
    loss: LossConfig = LossConfig()
    part_lrs: dict[str, float] = dataclasses.field(default_factory=dict)
    loop: LoopConfig = LoopConfig()
    mesh: MeshConfig | None = None  # None = single device
    dtype: str = "float32"  # target params
    # The architecture of `model` by name (`models.shapes.KNOWN_TARGETS`), so that `plan` can run where the
    # checkpoint is absent; where it is present, its config.json is used and must have this shape.
    target_shape: str = ""
    accelerator: str = ""  # the device type `mesh` is for (`accelerators.ACCELERATORS`): what `plan` checks
    eval_batches: int = setting(4, ge=1)

    def __post_init__(self) -> None:
        if not isinstance(self.drafter, Drafter):
            raise ValueError(f"drafter={self.drafter!r} must be a drafter with its settings, e.g. Medusa(num_heads=4) "
                             f"(in YAML: drafter: {{type: medusa, num_heads: 4}}; types: {', '.join(DRAFTERS)})")
        check_ranges(self)
        name = self.drafter.name
        if not self.drafter.trainable:
            raise ValueError(f"drafter {name} has nothing to train: use it directly (e.g. `amphista-jax generate "
                             f"--draft {name}`)")
        if self.draft_vocab_size:
            self._check_draft_vocab_size()
        drafter = self.trained_drafter()
        drafter.check_batches(bool(self.data.length_groups))
        if self.loss.labels == "target" and drafter.loss_runs_target:
            raise ValueError(f"drafter {name} runs the target inside its loss: it trains on loss.labels data")
        if self.loss.labels == "target" and self.loss.kind == "ce" and not drafter.reads_labels:
            fix = (f"set drafter.{drafter.lm_setting} > 0 for one" if drafter.lm_setting
                   else "leave loss.labels at data")
            raise ValueError(f"drafter {name} has no LM term here to learn loss.labels target with kind ce "
                             f"(its teacher term learns the target's whole distribution): {fix}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if bad := {k: v for k, v in self.part_lrs.items() if not v > 0}:
            raise ValueError(f"part_lrs {bad}: every learning rate must be > 0")
        if self.target_shape:
            known_target(self.target_shape)
        if self.accelerator:
            get_accelerator(self.accelerator)

    def _check_draft_vocab_size(self) -> None:
        name = self.drafter.name
        if "draft_vocab" not in {f.name for f in dataclasses.fields(self.drafter)}:
            raise ValueError(f"drafter {name} drafts over the target's own logits: it takes no {DRAFT_VOCAB_SIZE}")
        if self.drafter.draft_vocab:
            raise ValueError(f"{DRAFT_VOCAB_SIZE}={self.draft_vocab_size} and drafter.draft_vocab both give the "
                             "draft vocabulary: set one of them")

    @property
    def label_store_top_k(self) -> int:
        """How many of the target's top log-probs a position's labels keep in the label store (0: no labels
        stored): `loss.top_k` under `loss.labels: target`."""
        return self.loss.top_k if self.loss.labels == "target" else 0

    def trained_drafter(self, draft_vocab: DraftVocab | None = None) -> Drafter:
        """`drafter` as it trains: with `draft_vocab` (the one chosen for `draft_vocab_size`; None: ids
        `0 .. draft_vocab_size - 1`, of the same shapes, for what needs no data: checks and memory plans)."""
        if not self.draft_vocab_size:
            return self.drafter
        vocab = tuple(range(self.draft_vocab_size)) if draft_vocab is None else draft_vocab
        return dataclasses.replace(self.drafter, draft_vocab=vocab)


def old_form(data: Mapping[str, Any], overrides: Sequence[str], where: str) -> str | None:
    """Why a train config of the form before registered drafters cannot load, naming the form that replaced it
    (None: it is of the current form): a top-level `method` or `method_settings` in `data` (the YAML, its bases
    merged), or an override `method=X` / `method_settings.x=v`."""
    for item in overrides:
        key, _, value = item.partition("=")
        head, _, rest = key.strip().partition(".")
        if head == "method":
            return (f"--set {item}: method is gone: write --set drafter.type={value} (or --set 'drafter={{type: "
                    f"{value}}}' for its default settings)")
        if head == "method_settings":
            new = (f"{DRAFT_VOCAB_SIZE}={value}" if rest == DRAFT_VOCAB_SIZE else f"drafter.{rest}={value}" if rest
                   else "'drafter={type: <name>, <settings>}'")
            return f"--set {item}: method_settings is gone: write --set {new}"
    if "method" not in data and "method_settings" not in data:
        return None
    settings = data.get("method_settings")
    moved = (f" and {DRAFT_VOCAB_SIZE}: {settings[DRAFT_VOCAB_SIZE]} at the top level"
             if isinstance(settings, Mapping) and DRAFT_VOCAB_SIZE in settings else "")
    return (f"{where}: method/method_settings are gone: write drafter: {{type: {data.get('method') or '<name>'}, "
            f"<settings>}}{moved} (see {EXAMPLE})")


def load_train_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """`path` (YAML, with its `base:` files; None: all defaults) with `overrides` applied, as `load_config` reads
    it, after refusing the old form (`old_form`) in one line before anything else runs."""
    data = read_yaml(path) if path is not None else {}
    if why := old_form(data, overrides, str(path)):
        raise ConfigFileError(why)
    return load_config(TrainConfig, path, overrides)


def check_target_shape(name: str, config: ModelConfig, model: str) -> None:
    """`model`'s config must have the shape `target_shape` names (its token ids and limits may differ)."""
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    want = known_target(name)
    if diff := [f"{f} {getattr(config, f)} != {getattr(want, f)}" for f in fields
                if getattr(config, f) != getattr(want, f)]:
        raise TrainConfigError(f"model {model} is not a {name} ({', '.join(diff)}): fix target_shape or model")


def check_positions(cfg: TrainConfig, config: ModelConfig) -> None:
    if cfg.data.max_len > config.max_positions:
        raise TrainConfigError(f"data.max_len={cfg.data.max_len} exceeds the target's {config.max_positions} "
                               "positions: lower it")


def check_store_layers(store_layers: tuple[int, ...], captures: tuple[int, ...], num_layers: int) -> None:
    """`data.store_layers` must hold the method's captured layers and be layers of the target."""
    if missing := sorted(set(captures) - set(store_layers)):
        raise TrainConfigError(f"data.store_layers {list(store_layers)} lack the method's captured layers {missing}: "
                               "add them")
    if beyond := sorted(i for i in store_layers if i >= num_layers):
        raise TrainConfigError(f"data.store_layers {beyond} are not layers of the target ({num_layers} layers, ids "
                               f"0-{num_layers - 1}): remove them")


def check_batch_split(cfg: TrainConfig) -> None:
    """Each microbatch must split evenly over the mesh's batch axes (each process feeds the rows its devices
    hold)."""
    if not cfg.mesh:
        return
    rows, ways = cfg.data.batch_size // cfg.data.microbatches, cfg.mesh.data * cfg.mesh.fsdp
    if rows % ways:
        raise TrainConfigError(f"a microbatch of {rows} rows (data.batch_size {cfg.data.batch_size} / "
                               f"data.microbatches {cfg.data.microbatches}) does not split over mesh data x fsdp = "
                               f"{ways}: make it a multiple of {ways}")
