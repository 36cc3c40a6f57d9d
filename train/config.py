"""The train config: data, mesh and method settings of `amphista-jax train`, each checked when it is made."""

from __future__ import annotations

import dataclasses
from typing import Any

from amphista_jax.drafters import DRAFTERS, Drafter
from amphista_jax.drafters.draft_vocab import DraftVocab
from amphista_jax.infra.accelerators import get_accelerator
from amphista_jax.infra.errors import UserError
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
    heldout_fraction: float = 0.05  # kind "stdlib" with a `corpus`: the recipe's own fraction is used
    # kind "stdlib": whose corpus: a target recipe YAML, or an exported target directory (its
    # training_summary.json); "" = the standard library alone
    corpus: str = ""
    max_len: int = 256
    batch_size: int = 8  # rows per step, over all processes (each process reads batch_size / processes)
    # Each step runs its batch as this many sequential slices and averages their gradients weighted by their loss
    # tokens (gradient accumulation, `train.step.over_microbatches`): the same batch and step count, with
    # 1/microbatches of the activation memory.
    microbatches: int = 1
    seed: int = 0
    cache_target_hidden: bool = False  # precompute the target's hidden states once (small targets)
    hidden_store: str = ""  # with cache_target_hidden: keep them in this directory for later runs ("": don't)
    # with hidden_store: the target layers whose inputs the store keeps, a superset of the method's captured layers
    # (`captured_layers`, as ids from 0), so that methods capturing different layers (EAGLE-3's, DFlash's) share
    # one target pass and one file; () = the method's own
    store_layers: tuple[int, ...] = ()
    max_examples: int = 0  # at most this many examples of each data file (0: all); a held-out split comes from them
    # > 0: the shuffled examples are taken this many batches at a time and sorted by length there, and each batch is
    # cut at its longest row (`data.length_grouped_dataset`): padding left out of the step's compute, one compiled
    # step per cut; 0: batches of random rows at data.max_len
    length_groups: int = 0

    def __post_init__(self) -> None:
        if self.kind not in DATA_KINDS:
            raise ValueError(f"data.kind {self.kind!r} must be one of {', '.join(DATA_KINDS)}")
        if not self.train and self.kind != "stdlib":
            raise ValueError("data.train is empty: set it to a conversations file, a directory or a glob")
        if self.max_len < 2:
            raise ValueError(f"data.max_len={self.max_len} must be >= 2 (a token and the next one to predict)")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size={self.batch_size} must be >= 1")
        if self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ValueError(f"data.microbatches={self.microbatches} must be >= 1 and divide data.batch_size="
                             f"{self.batch_size}")
        if self.max_examples < 0:
            raise ValueError(f"data.max_examples={self.max_examples} must be >= 0 (0 = all)")
        if self.length_groups < 0:
            raise ValueError(f"data.length_groups={self.length_groups} must be >= 0 (0 = batches at data.max_len)")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.store_layers) or len(
                set(self.store_layers)) != len(self.store_layers):
            raise ValueError(f"data.store_layers={list(self.store_layers)} must be distinct layer ids >= 0")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"data.heldout_fraction={self.heldout_fraction} must be in (0, 1)")


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
    top_k: int = 32

    def __post_init__(self) -> None:
        if self.labels not in LABELS:
            raise ValueError(f"loss.labels {self.labels!r} must be one of {', '.join(LABELS)}")
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"loss.kind {self.kind!r} must be one of {', '.join(LOSS_KINDS)}")
        if self.kind == "kl" and self.labels != "target":
            raise ValueError("loss.kind kl learns the target's distribution: set loss.labels to target")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"loss.top_k={self.top_k!r} must be an integer >= 1")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for name in ("data", "fsdp", "tensor"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


DRAFT_VOCAB_SIZE = "draft_vocab_size"  # a method_settings key the trainer reads (no drafter field)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data: DataConfig
    model: str = ""  # HF checkpoint directory; "" = the embedded default
    out_dir: str = "runs/heads"
    method: str = "medusa"
    method_settings: dict[str, Any] = dataclasses.field(default_factory=dict)
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
    eval_batches: int = 4

    def __post_init__(self) -> None:
        if self.method not in DRAFTERS:
            raise ValueError(f"method {self.method!r} is not one of {', '.join(DRAFTERS)}")
        if not DRAFTERS[self.method].trainable:
            raise ValueError(f"method {self.method!r} has nothing to train: use it directly (e.g. `amphista-jax "
                             f"generate --draft {self.method}`)")
        known = {f.name for f in dataclasses.fields(DRAFTERS[self.method])}
        if unknown := set(self.method_settings) - known - {DRAFT_VOCAB_SIZE}:
            raise ValueError(f"method_settings {sorted(unknown)} are not {self.method} settings; "
                             f"known: {', '.join(sorted(known | {DRAFT_VOCAB_SIZE}))}")
        if DRAFT_VOCAB_SIZE in self.method_settings:
            self._check_draft_vocab_size("draft_vocab" in known)
        drafter = self.drafter()  # the method validates its own values
        drafter.check_batches(bool(self.data.length_groups))
        if self.loss.labels == "target" and drafter.loss_runs_target:
            raise ValueError(f"method {self.method} runs the target inside its loss: it trains on loss.labels data")
        if self.loss.labels == "target" and self.loss.kind == "ce" and not drafter.reads_labels:
            fix = (f"set method_settings.{drafter.lm_setting} > 0 for one" if drafter.lm_setting
                   else "leave loss.labels at data")
            raise ValueError(f"method {self.method} has no LM term here to learn loss.labels target with kind ce "
                             f"(its teacher term learns the target's whole distribution): {fix}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if bad := {k: v for k, v in self.part_lrs.items() if not v > 0}:
            raise ValueError(f"part_lrs {bad}: every learning rate must be > 0")
        if self.eval_batches < 1:
            raise ValueError(f"eval_batches={self.eval_batches} must be >= 1")
        if self.target_shape:
            known_target(self.target_shape)
        if self.accelerator:
            get_accelerator(self.accelerator)

    def _check_draft_vocab_size(self, supported: bool) -> None:
        n = self.method_settings[DRAFT_VOCAB_SIZE]
        if not supported:
            raise ValueError(f"method {self.method} drafts over the target's own logits: it takes no "
                             f"{DRAFT_VOCAB_SIZE}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or "draft_vocab" in self.method_settings:
            raise ValueError(f"method_settings.{DRAFT_VOCAB_SIZE}={n!r} must be an integer >= 1, without draft_vocab")

    @property
    def draft_vocab_size(self) -> int:
        """`method_settings.draft_vocab_size`: how many tokens to draft over (0: the whole vocabulary)."""
        return self.method_settings.get(DRAFT_VOCAB_SIZE, 0)

    @property
    def label_store_top_k(self) -> int:
        """How many of the target's top log-probs a position's labels keep in the label store (0: no labels
        stored): `loss.top_k` under `loss.labels: target`."""
        return self.loss.top_k if self.loss.labels == "target" else 0

    def drafter(self, draft_vocab: DraftVocab | None = None) -> Drafter:
        """The method with its settings and `draft_vocab` (the one chosen for `draft_vocab_size`; None: ids
        `0 .. draft_vocab_size - 1`, of the same shapes, for what needs no data: checks and memory plans)."""
        settings = {k: v for k, v in self.method_settings.items() if k != DRAFT_VOCAB_SIZE}
        if self.draft_vocab_size:
            settings["draft_vocab"] = tuple(range(self.draft_vocab_size)) if draft_vocab is None else draft_vocab
        return DRAFTERS[self.method].from_settings(settings)


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
