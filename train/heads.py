"""Train draft heads on a frozen target: `amphista-jax train --config configs/medusa/tiny-code.yaml`.

Every draft method trains through here: the method comes from `DRAFTERS[method](**method_settings)` and
only its `init` and `loss` are used. Data is ShareGPT-style conversations (chat template, assistant-only
loss) or plain text/code; the target is sharded over a `(data, fsdp, tensor)` mesh; the loop (checkpoints,
resume, SIGTERM, progress, JSONL metrics) is `amphista_jax.train.loop.run_loop`. At the end the heads are saved with the
target's fingerprint (`out_dir/heads`) and the training curve is plotted (`out_dir/training_curve.png`).

`method_settings.draft_vocab_size: N` (a trainer setting, not a drafter field) drafts over the N most frequent
label tokens of the training examples (`drafters.draft_vocab`), chosen before the heads are initialised and saved
in their `draft_vocab` setting.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from amphista_jax import config_io
from amphista_jax.accelerators import GIB, get_accelerator
from amphista_jax.drafters import DRAFTERS, Drafter
from amphista_jax.drafters.draft_vocab import DraftVocab, most_frequent, token_counts
from amphista_jax.drafters.io import META_FILE, save_draft
from amphista_jax.errors import OutputExistsError, UserError, check_writable_dir
from amphista_jax.fetch import resolve_data, resolve_model
from amphista_jax.identity import files_digest, json_digest, matching_files, target_identity
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.hf import DTYPES, load_config, load_params, param_dtype
from amphista_jax.models.llama import Transformer, param_shapes
from amphista_jax.models.shapes import known_target
from amphista_jax.plan import MemoryPlan, abstract, accelerator_capacity, compiled_plan, mesh_devices, plan_table
from amphista_jax.sharding import (
    make_mesh,
    param_shardings,
    process_batch_rows,
    train_state_shardings,
)
from amphista_jax.target import Target
from amphista_jax.tokenizer import load_tokenizer
from amphista_jax.train.checkpoint import saved_steps
from amphista_jax.train.corpus import build_corpus, package_version
from amphista_jax.train.data import DataError, conversation_examples, example_dataset, packed_examples, text_examples
from amphista_jax.train.loop import LoopConfig, maybe_initialize_distributed, mean_metrics, read_metrics, run_loop
from amphista_jax.train.optim import OptimConfig, make_optimizer
from amphista_jax.train.pretrain_target import PretrainConfig
from amphista_jax.train.run_identity import RUN_FILE, check_same_run, read_identity, write_identity
from amphista_jax.train.step import Step, make_steps, target_forward

DATA_KINDS = ("text", "sharegpt", "stdlib")
OUTPUTS = ("checkpoints", "metrics.jsonl", "heads", "summary.json", "training_curve.png")  # what a run writes


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
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"data.heldout_fraction={self.heldout_fraction} must be in (0, 1)")


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
        self.drafter()  # the method validates its own values
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

    def drafter(self, draft_vocab: DraftVocab | None = None) -> Drafter:
        """The method with its settings and `draft_vocab` (the one chosen for `draft_vocab_size`; None: ids
        `0 .. draft_vocab_size - 1`, of the same shapes, for what needs no data: checks and memory plans)."""
        settings = {k: v for k, v in self.method_settings.items() if k != DRAFT_VOCAB_SIZE}
        if self.draft_vocab_size:
            settings["draft_vocab"] = tuple(range(self.draft_vocab_size)) if draft_vocab is None else draft_vocab
        return DRAFTERS[self.method](**settings)


def choose_draft_vocab(cfg: TrainConfig, examples: list[dict], vocab_size: int) -> DraftVocab | None:
    """The `cfg.draft_vocab_size` most frequent label tokens (`tokens` where `loss_mask` is 1) of the training
    `examples`, ties by id; None without a `draft_vocab_size`."""
    if not cfg.draft_vocab_size:
        return None
    tokens = np.concatenate([np.ravel(e["tokens"]) for e in examples])
    mask = np.concatenate([np.ravel(e["loss_mask"]) for e in examples])
    return most_frequent(token_counts(tokens, mask, vocab_size), cfg.draft_vocab_size)


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


def _corpus_recipe(cfg: DataConfig) -> PretrainConfig | None:
    """The target recipe whose corpus kind "stdlib" reads (None: the standard library alone)."""
    if not cfg.corpus:
        return None
    summary = Path(cfg.corpus) / "training_summary.json"
    if summary.is_file():
        return config_io.from_dict(PretrainConfig, json.loads(summary.read_text())["config"], f"{summary}: ")
    if not Path(cfg.corpus).is_file():
        raise TrainConfigError(f"data.corpus {cfg.corpus} is neither a target recipe YAML nor an exported target "
                               "directory (with training_summary.json): fix the path, or set data.corpus='' for "
                               "the standard library alone")
    return config_io.load_config(PretrainConfig, cfg.corpus, [])


def _stdlib_texts(cfg: DataConfig) -> tuple[list[str], list[str]]:
    if t := _corpus_recipe(cfg):
        corpus = build_corpus(t.stdlib, t.packages, t.exclude_tests, t.heldout_fraction, t.max_source_mb)
    else:
        corpus = build_corpus(True, (), False, cfg.heldout_fraction)
    print(f"code corpus ({', '.join(corpus.manifest['sources'])}): {len(corpus.train)} train / "
          f"{len(corpus.heldout)} held-out files")
    return corpus.train, corpus.heldout


def split_examples(cfg: DataConfig, tok: Any) -> tuple[list, list]:
    """(train, held-out) examples of `cfg`: its held-out file, else a seeded `heldout_fraction` split."""
    if cfg.kind == "stdlib":
        train_texts, heldout_texts = _stdlib_texts(cfg)
        return packed_examples(train_texts, tok, cfg.max_len), packed_examples(heldout_texts, tok, cfg.max_len)
    load = (lambda src: conversation_examples(src, tok, cfg.max_len)) if cfg.kind == "sharegpt" else (
        lambda src: text_examples(src, tok, cfg.max_len))
    train, report = load(cfg.train)
    print(report.summary())
    if cfg.heldout:
        heldout, held_report = load(cfg.heldout)
        print(held_report.summary())
        return train, heldout
    order = np.random.RandomState(cfg.seed).permutation(len(train))
    n_held = max(1, int(len(train) * cfg.heldout_fraction))
    if len(train) - n_held < cfg.batch_size:
        raise DataError(f"{cfg.train} has {len(train)} examples: too few for a held-out split and a batch of "
                        f"{cfg.batch_size}; add data or set data.heldout")
    return [train[i] for i in order[n_held:]], [train[i] for i in order[:n_held]]


def heldout_examples(cfg: DataConfig, tok: Any) -> list:
    """The held-out examples of `split_examples` (for the stdlib corpus, without tokenising the train split)."""
    if cfg.kind == "stdlib":
        return packed_examples(_stdlib_texts(cfg)[1], tok, cfg.max_len)
    return split_examples(cfg, tok)[1]


def batch_examples(examples: list[dict], batch_size: int, max_batches: int) -> list[dict[str, np.ndarray]]:
    """Up to `max_batches` full batches (fixed, shardable shapes) of `examples`, in order."""
    n = min(len(examples) // batch_size, max_batches)
    if n == 0:
        raise DataError(f"{len(examples)} held-out examples are fewer than one batch of {batch_size}: add held-out "
                        "data, raise data.heldout_fraction or lower data.batch_size")
    return [{k: np.stack([e[k] for e in examples[i * batch_size: (i + 1) * batch_size]]) for k in examples[0]}
            for i in range(n)]


def _with_hidden(examples: list[dict], model: Transformer, target_params: dict, batch: int) -> list[dict]:
    """Attach the target's hidden states `[T, D]` (fp16 on host) to every example."""
    forward = jax.jit(lambda p, t: target_forward(model, p, {"tokens": t}).hidden.astype(jnp.float16))
    out = []
    for i in range(0, len(examples), batch):
        chunk = examples[i: i + batch]
        hidden = np.asarray(forward(target_params, jnp.asarray(np.stack([e["tokens"] for e in chunk]))))
        out += [e | {"hidden": h} for e, h in zip(chunk, hidden, strict=True)]
    return out


def _check_data(cfg: DataConfig) -> None:
    if cfg.kind == "stdlib":
        for package in (t := _corpus_recipe(cfg)) and t.packages or ():
            package_version(package)  # installed, or a one-line error naming it
        return
    for name, path in (("data.train", cfg.train), ("data.heldout", cfg.heldout)):
        if not path:
            continue
        if cfg.kind == "sharegpt" and not Path(path).is_file():
            raise TrainConfigError(f"{name} {path} is not a file: point it at a conversations JSON / JSONL file")
        if not matching_files(path):
            raise TrainConfigError(f"{name} {path} matches no file: point it at a file, a directory or a glob of "
                                   "text files")


def _data_identity(cfg: DataConfig) -> dict[str, Any]:
    if cfg.kind == "stdlib":  # the recipe of a corpus read from installed sources, and those sources' versions
        t = _corpus_recipe(cfg)
        recipe = ({k: getattr(t, k) for k in ("stdlib", "packages", "exclude_tests", "heldout_fraction",
                                              "max_source_mb")} if t else
                  {"stdlib": True, "packages": (), "exclude_tests": False, "heldout_fraction": cfg.heldout_fraction})
        versions = {"python": platform.python_version()} | {p: package_version(p) for p in recipe["packages"]}
        return {"data.corpus": {"sha256": json_digest([recipe, versions]), "recipe": recipe, "versions": versions}}
    return {name: files_digest(matching_files(path), Path(path) if Path(path).is_dir() else None)
            for name, path in (("data.train", cfg.train), ("data.heldout", cfg.heldout)) if path}


def run_identity(cfg: TrainConfig, model_dir: str) -> dict[str, Any]:
    """What this run is: its config and digests of the target's files and of the data (`train/run_identity`)."""
    return {"config": dataclasses.asdict(cfg),
            "target": target_identity(model_dir),
            "data": _data_identity(cfg.data)}


def preflight(cfg: TrainConfig) -> tuple[str, dict[str, Any]]:
    """Everything that can be checked before loading the target and tokenising data, so that a bad setting fails
    in the first seconds: the target, the data files, the mesh, the method on this target, `part_lrs`, that
    `out_dir` is writable with room for the checkpoints, and that it holds no other run. Returns (model dir,
    this run's identity)."""
    model_dir = resolve_model(cfg.model)
    target_config = load_config(model_dir)
    if not any(Path(model_dir).glob("*.safetensors")):
        raise TrainConfigError(f"model {model_dir} has no *.safetensors weights (PyTorch .bin checkpoints are not "
                               "supported: re-save with safe_serialization=True)")
    if cfg.mesh and (n := cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor) != jax.device_count():
        raise TrainConfigError(f"mesh {cfg.mesh.data} x {cfg.mesh.fsdp} x {cfg.mesh.tensor} = {n} devices, but "
                               f"{jax.device_count()} are available: choose sizes whose product is the device "
                               "count, or set mesh=null for one device")
    check_positions(cfg, target_config)
    if cfg.target_shape:
        check_target_shape(cfg.target_shape, target_config, model_dir)
    check_batch_split(cfg)
    _check_data(cfg.data)
    if cfg.draft_vocab_size > target_config.vocab_size:
        raise TrainConfigError(f"method_settings.{DRAFT_VOCAB_SIZE}={cfg.draft_vocab_size} exceeds the target's "
                               f"{target_config.vocab_size} tokens: lower it")
    drafter = cfg.drafter()
    if cfg.data.cache_target_hidden and drafter.loss_runs_target:
        raise TrainConfigError(f"method {cfg.method} runs the target inside its own loss, so cached target hidden "
                               "states would be computed and never used: set data.cache_target_hidden=false")
    try:
        heads = jax.eval_shape(lambda p: drafter.init(jax.random.key(0), Target(target_config, p)),
                               param_shapes(target_config)[0])
    except ValueError as e:
        raise TrainConfigError(f"method {cfg.method} {cfg.method_settings} does not fit the target {model_dir}: "
                               f"{e}") from e
    if unknown := set(cfg.part_lrs) - set(heads):
        raise TrainConfigError(f"part_lrs {sorted(unknown)} are not {cfg.method} parameter groups; groups: "
                               f"{', '.join(sorted(heads))}")
    head_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(heads))
    # checkpoints of params + Adam's two moments (one more while the oldest is replaced), and the saved heads
    check_writable_dir(cfg.out_dir, "out_dir", head_bytes * (3 * (cfg.loop.keep_checkpoints + 1) + 1))
    out = Path(cfg.out_dir)
    taken = [n for n in OUTPUTS if (out / n).exists() and (n != "checkpoints" or saved_steps(out / n))]
    if taken and read_identity(out) is None:
        raise OutputExistsError(f"out_dir {out} already holds {', '.join(taken)} but no {RUN_FILE} (a run of an older "
                                "amphista-jax, or not a train run): its settings cannot be checked against these, "
                                "so it is left as it is; use a new out_dir")
    identity = run_identity(cfg, model_dir)
    if taken:  # a run.json with nothing trained is from a start that failed early: this start replaces it
        check_same_run(out, identity)
    return model_dir, identity


@dataclasses.dataclass(frozen=True)
class TrainJob:
    """What a train run compiles, from its config and the target's shape alone (no weights)."""

    config: ModelConfig
    model: Transformer
    drafter: Drafter
    optimizer: optax.GradientTransformation
    mesh: Mesh | None
    target_shardings: Any  # None: one device
    state_shardings: dict | None
    train_step: Step
    eval_step: Step
    new_state: Callable[[Target], dict[str, Any]]  # jitted: each array made in place on its shards


def train_job(cfg: TrainConfig, target_config: ModelConfig, devices: list[jax.Device] | None = None,
              draft_vocab: DraftVocab | None = None) -> TrainJob:
    """`cfg`'s job on `devices` (default: all of them), drafting over `draft_vocab` (`TrainConfig.drafter`)."""
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices) if cfg.mesh else None
    target_shardings = param_shardings(target_config, mesh) if mesh else None
    model = Transformer(target_config)
    drafter = cfg.drafter(draft_vocab)
    optimizer = make_optimizer(cfg.optim, cfg.loop.steps, cfg.part_lrs or None)
    abstract_target = Target(target_config, param_shapes(target_config)[0])
    state_shardings = train_state_shardings(drafter, abstract_target, optimizer, mesh) if mesh else None
    train_step, eval_step = make_steps(model, drafter, optimizer, mesh, target_shardings, state_shardings,
                                       cfg.data.microbatches)

    @functools.partial(jax.jit, **({"out_shardings": state_shardings} if mesh else {}))
    def new_state(target: Target) -> dict[str, Any]:
        params = drafter.init(jax.random.key(cfg.data.seed), target)
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    return TrainJob(target_config, model, drafter, optimizer, mesh, target_shardings, state_shardings, train_step,
                    eval_step, new_state)


def batch_shapes(cfg: DataConfig, batch: int, hidden_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch the train step takes: the examples' arrays stacked `batch` deep."""
    shapes = {"tokens": jax.ShapeDtypeStruct((batch, cfg.max_len), jnp.int32),
              "loss_mask": jax.ShapeDtypeStruct((batch, cfg.max_len), jnp.int32)}
    if cfg.cache_target_hidden:
        shapes["hidden"] = jax.ShapeDtypeStruct((batch, cfg.max_len, hidden_size), jnp.float16)
    return shapes


def plan_training(cfg: TrainConfig, job: TrainJob, target_dtype: Any, capacity: int | None = None,
                  where: str = "") -> MemoryPlan:
    """The memory plan of `job`'s train step, compiled from abstract shapes (the target's params in
    `target_dtype`)."""
    params = abstract(param_shapes(job.config, target_dtype)[0], job.target_shardings)
    state = abstract(jax.eval_shape(job.new_state, Target(job.config, params)), job.state_shardings)
    batch = batch_shapes(cfg.data, cfg.data.batch_size, job.config.hidden_size)
    if job.mesh is not None:
        batch = abstract(batch, jax.tree.map(lambda _: Step.batch_spec(job.mesh), batch))
    compiled = job.train_step.compile(state, params, batch)
    return compiled_plan(f"train {cfg.method}", compiled, {
        "target params": params, "draft params": state["params"],
        "optimizer state": (state["opt_state"], state["step"]), "batch": batch}, mesh_devices(job.mesh), capacity,
        where)


def _finished(cfg: TrainConfig) -> dict[str, Any] | None:
    """The summary of `out_dir` when it holds this run, trained to the end and saved; else None."""
    out = Path(cfg.out_dir)
    steps = saved_steps(out / "checkpoints")
    done = steps and steps[-1] >= cfg.loop.steps and (out / "heads" / META_FILE).is_file()
    return json.loads((out / "summary.json").read_text()) if done and (out / "summary.json").is_file() else None


def with_fetched_data(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with registry data names (`data.train: sharegpt`) replaced by their fetched files (fetched on first
    use: `amphista-jax fetch`)."""
    data = dataclasses.replace(cfg.data, train=resolve_data(cfg.data.train), heldout=resolve_data(cfg.data.heldout))
    return dataclasses.replace(cfg, data=data)


def train_heads(cfg: TrainConfig) -> dict[str, Any]:
    maybe_initialize_distributed()
    cfg = with_fetched_data(cfg)
    model_dir, identity = preflight(cfg)
    if (summary := _finished(cfg)) is not None:
        print(f"{cfg.out_dir} is already trained ({summary['steps']} steps with these settings, target and data): "
              f"its heads are in {Path(cfg.out_dir) / 'heads'}; nothing was changed (use a new out_dir to train "
              "again)")
        return summary
    target_config = load_config(model_dir)
    tok = load_tokenizer(model_dir)
    train_examples, heldout = split_examples(cfg.data, tok)
    job = train_job(cfg, target_config, draft_vocab=choose_draft_vocab(cfg, train_examples, target_config.vocab_size))
    plan = plan_training(cfg, job, param_dtype(model_dir, cfg.dtype), *accelerator_capacity(None))
    if jax.process_index() == 0:
        print(f"{plan_table([plan])}\nmemory plan: {plan.verdict()}")
    if plan.fits is False:
        raise TrainConfigError(f"the train step needs {plan.total / GIB:.2f} GiB per device, more than the "
                               f"{plan.capacity / GIB:.2f} GiB of {plan.where}: raise data.microbatches, lower "
                               "data.max_len, or use more devices (mesh)")
    target_params, target_config = load_params(model_dir, dtype=cfg.dtype, shardings=job.target_shardings)
    if cfg.data.cache_target_hidden:
        train_examples = _with_hidden(train_examples, job.model, target_params, cfg.data.batch_size)
        heldout = _with_hidden(heldout, job.model, target_params, cfg.data.batch_size)
    drafter, train_step, eval_step = job.drafter, job.train_step, job.eval_step
    init_state = functools.partial(job.new_state, Target(target_config, target_params))  # made in place on shards

    rows = process_batch_rows(job.mesh, cfg.data.batch_size)  # this process's rows of every global batch
    heldout_batches = [jax.tree.map(lambda x: x[rows], b)
                       for b in batch_examples(heldout, cfg.data.batch_size, cfg.eval_batches)]

    def evaluate(state: dict[str, Any]) -> dict[str, float]:
        return mean_metrics([eval_step(state["params"], target_params, b) for b in heldout_batches])

    settings = dataclasses.asdict(drafter) | ({"draft_vocab": f"{n} tokens"} if (n := len(drafter.draft_vocab)) else {})
    print(f"target {model_dir}: {target_config.num_params:,} parameters; method {cfg.method} {settings}; "
          f"{len(train_examples)} train / {len(heldout)} held-out examples")
    out_dir = Path(cfg.out_dir)
    if jax.process_index() == 0 and not saved_steps(out_dir / "checkpoints"):
        write_identity(out_dir, identity)  # at the first start; a resume has just been checked against it
        # rows of this same run (checked above) from a start killed before its first checkpoint: redone now
        (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    before = evaluate(init_state())
    state, extra = run_loop(
        run_dir=out_dir, cfg=cfg.loop, init_state=init_state,
        train_step=lambda s, b: train_step(s, target_params, b),
        data=iter(example_dataset(train_examples, cfg.data.batch_size, cfg.data.seed, rows)), evaluate=evaluate,
        tokens_per_batch=cfg.data.batch_size * cfg.data.max_len, desc=f"train {cfg.method}")
    summary = {
        "method": cfg.method, "settings": dataclasses.asdict(drafter), "model": model_dir,
        "steps": extra["steps"], "tokens_seen": extra["tokens_seen"], "train_seconds": round(extra["train_seconds"], 1),
        "heldout_before": before, "heldout_after": extra["eval"],
    }
    save_draft(out_dir / "heads", cfg.method, drafter, state["params"], target_config,
               target_params=target_params)  # collective in orbax
    if jax.process_index() == 0:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_curve(out_dir)
    print(json.dumps({"heldout_before": before, "heldout_after": extra["eval"]}, indent=2))
    return summary


def plot_curve(run_dir: str | Path) -> Path:
    """`training_curve.png`: train loss and held-out per-head top-1 accuracy over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    train = [r for r in rows if "loss" in r]
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    evals = [r for r in rows if "eval/loss" in r]
    ax_loss.plot([r["step"] for r in evals], [r["eval/loss"] for r in evals], "o-", label="held-out")
    ax_loss.set(xlabel="step", ylabel="loss", title="draft loss")
    ax_loss.legend()
    heads = sorted({k.split("/")[1] for r in evals for k in r if k.startswith("eval/head") and k.endswith("/top1")})
    for h in heads:
        ax_acc.plot([r["step"] for r in evals], [r[f"eval/{h}/top1"] for r in evals], "o-", label=h)
    ax_acc.set(xlabel="step", ylabel="held-out top-1", title="per-head accuracy")
    if heads:
        ax_acc.legend()
    fig.tight_layout()
    path = Path(run_dir) / "training_curve.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
