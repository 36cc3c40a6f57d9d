"""Train draft heads on a frozen target: `amphista-jax train --config configs/medusa/tiny-code.yaml`.

Every draft method trains through here: the config's `drafter` (a registered `Drafter`, `drafter: {type: <name>,
<settings>}`), of which only `init` and `loss` are used. Data is ShareGPT-style conversations (chat template,
assistant-only loss) or plain text/code; the target is sharded over a `(data, fsdp, tensor)` mesh; the loop
(checkpoints, resume, SIGTERM, progress, JSONL metrics) is `amphista_jax.train.loop.run_loop`. At the end the heads
are saved with the target's fingerprint (`out_dir/heads`) and the training curve is plotted
(`out_dir/training_curve.png`).

`draft_vocab_size: N` (a trainer setting, not a drafter field) drafts over the N most frequent
label tokens of the training examples (`drafters.draft_vocab`), chosen before the heads are initialised and saved
in their `draft_vocab` setting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from amphista_jax.drafters import Drafter
from amphista_jax.drafters.draft_vocab import DraftVocab
from amphista_jax.drafters.io import META_FILE, save_draft
from amphista_jax.engine.memory_plan import (
    MemoryPlan,
    abstract,
    accelerator_capacity,
    compiled_plan,
    mesh_devices,
    plan_table,
)
from amphista_jax.engine.sharding import (
    make_mesh,
    param_shardings,
    process_batch_rows,
    train_state_shardings,
)
from amphista_jax.infra.accelerators import GIB
from amphista_jax.infra.compile_cache import enable_compile_cache
from amphista_jax.infra.config_io import to_dict
from amphista_jax.infra.errors import OutputExistsError, check_writable_dir
from amphista_jax.infra.figures import pyplot, save_figure
from amphista_jax.infra.home import amphista_home
from amphista_jax.infra.identity import target_identity
from amphista_jax.infra.output_lock import output_lock, write_atomic
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.fetch import resolve_model
from amphista_jax.models.hf import load_config, load_params, param_dtype
from amphista_jax.models.llama import Transformer, param_shapes
from amphista_jax.models.target import Target
from amphista_jax.models.tokenizer import load_tokenizer
from amphista_jax.train.checkpoint import saved_steps
from amphista_jax.train.config import (
    DRAFT_VOCAB_SIZE,
    DataConfig,
    TrainConfig,
    TrainConfigError,
    check_batch_split,
    check_positions,
    check_store_layers,
    check_target_shape,
)
from amphista_jax.train.data import DataError, example_dataset, length_grouped_dataset, trained_lengths
from amphista_jax.train.examples import batch_examples, choose_draft_vocab, example_source, stored_fields, with_hidden
from amphista_jax.train.loop import maybe_initialize_distributed, mean_metrics, read_metrics, run_loop
from amphista_jax.train.optim import make_optimizer
from amphista_jax.train.run_identity import RUN_FILE, check_same_run, read_identity, write_identity
from amphista_jax.train.step import Step, make_steps

OUTPUTS = ("checkpoints", "metrics.jsonl", "heads", "summary.json", "training_curve.png")  # what a run writes


def run_identity(cfg: TrainConfig, model_dir: str) -> dict[str, Any]:
    """What this run is: its config and digests of the target's files and of the data (`train/run_identity`)."""
    return {"config": to_dict(cfg),
            "target": target_identity(model_dir),
            "data": example_source(cfg.data).identity()}


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What `preflight` found, and the run consumes: the target's directory and config, and this run's identity."""

    model_dir: str
    target_config: ModelConfig
    identity: dict[str, Any]


def preflight(cfg: TrainConfig) -> Preflight:
    """Everything that can be checked before loading the target and tokenising data, so that a bad setting fails
    in the first seconds: the target, the data files, the mesh, the method on this target, `part_lrs`, that
    `out_dir` is writable with room for the checkpoints, and that it holds no other run (`check_out_dir`)."""
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
    example_source(cfg.data).check()
    if cfg.draft_vocab_size > target_config.vocab_size:
        raise TrainConfigError(f"{DRAFT_VOCAB_SIZE}={cfg.draft_vocab_size} exceeds the target's "
                               f"{target_config.vocab_size} tokens: lower it")
    drafter = cfg.trained_drafter()
    if cfg.data.cache_target_hidden and cfg.data.store_layers:
        check_store_layers(cfg.data.store_layers, drafter.captured_layers(target_config), target_config.num_layers)
    if cfg.data.cache_target_hidden and drafter.loss_runs_target:
        raise TrainConfigError(f"drafter {drafter.name} runs the target inside its own loss, so cached target hidden "
                               "states would be computed and never used: set data.cache_target_hidden=false")
    try:
        heads = jax.eval_shape(lambda p: drafter.init(jax.random.key(0), Target(target_config, p)),
                               param_shapes(target_config)[0])
    except ValueError as e:
        raise TrainConfigError(f"drafter {cfg.drafter} does not fit the target {model_dir}: {e}") from e
    if unknown := set(cfg.part_lrs) - set(heads):
        raise TrainConfigError(f"part_lrs {sorted(unknown)} are not {drafter.name} parameter groups; groups: "
                               f"{', '.join(sorted(heads))}")
    head_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(heads))
    # checkpoints of params + Adam's two moments (one more while the oldest is replaced), and the saved heads
    check_writable_dir(cfg.out_dir, "out_dir", head_bytes * (3 * (cfg.loop.keep_checkpoints + 1) + 1))
    found = Preflight(model_dir, target_config, run_identity(cfg, model_dir))
    check_out_dir(cfg, found.identity)
    return found


def check_out_dir(cfg: TrainConfig, identity: dict[str, Any]) -> None:
    """`out_dir` holds nothing, or this same run (`identity`) to resume: checked by `preflight`, and again under
    the directory's lock, where another run may have written meanwhile."""
    out = Path(cfg.out_dir)
    taken = [n for n in OUTPUTS if (out / n).exists() and (n != "checkpoints" or saved_steps(out / n))]
    if taken and read_identity(out) is None:
        raise OutputExistsError(f"out_dir {out} already holds {', '.join(taken)} but no {RUN_FILE} (a run of an older "
                                "amphista-jax, or not a train run): its settings cannot be checked against these, "
                                "so it is left as it is; use a new out_dir")
    if taken:  # a run.json with nothing trained is from a start that failed early: this start replaces it
        check_same_run(out, identity)


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
    """`cfg`'s job on `devices` (default: all of them), drafting over `draft_vocab` (`TrainConfig.trained_drafter`)."""
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices) if cfg.mesh else None
    target_shardings = param_shardings(target_config, mesh) if mesh else None
    model = Transformer(target_config)
    drafter = cfg.trained_drafter(draft_vocab)
    optimizer = make_optimizer(cfg.optim, cfg.loop.steps, cfg.part_lrs or None)
    abstract_target = Target(target_config, param_shapes(target_config)[0])
    state_shardings = train_state_shardings(drafter, abstract_target, optimizer, mesh) if mesh else None
    train_step, eval_step = make_steps(model, drafter, optimizer, mesh, target_shardings, state_shardings,
                                       cfg.data.microbatches, cfg.loss)

    @functools.partial(jax.jit, **({"out_shardings": state_shardings} if mesh else {}))
    def new_state(target: Target) -> dict[str, Any]:
        params = drafter.init(jax.random.key(cfg.data.seed), target)
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}

    return TrainJob(target_config, model, drafter, optimizer, mesh, target_shardings, state_shardings, train_step,
                    eval_step, new_state)


def batch_shapes(cfg: TrainConfig, hidden_size: int, captures: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch the train step takes: the examples' arrays stacked `data.batch_size` deep (`captures`: how
    many captured layers' inputs ride along with cached hidden states; the label store's top-k with them under
    `loss.labels: target`)."""
    rows, length = cfg.data.batch_size, cfg.data.max_len
    shapes = {"tokens": jax.ShapeDtypeStruct((rows, length), jnp.int32),
              "loss_mask": jax.ShapeDtypeStruct((rows, length), jnp.int32)}
    if cfg.data.cache_target_hidden:
        shapes |= {name: jax.ShapeDtypeStruct((rows, length, width), dtype)
                   for name, (width, dtype) in stored_fields(hidden_size, captures, cfg.label_store_top_k).items()}
    return shapes


def plan_training(cfg: TrainConfig, job: TrainJob, target_dtype: Any, capacity: int | None = None,
                  where: str = "") -> MemoryPlan:
    """The memory plan of `job`'s train step, compiled from abstract shapes (the target's params in
    `target_dtype`), with its FLOPs where XLA can count them (`memory_plan.loop_free_flops`)."""
    params = abstract(param_shapes(job.config, target_dtype)[0], job.target_shardings)
    state = abstract(jax.eval_shape(job.new_state, Target(job.config, params)), job.state_shardings)
    batch = batch_shapes(cfg, job.config.hidden_size, len(job.drafter.captured_layers(job.config)))
    if job.mesh is not None:
        batch = abstract(batch, jax.tree.map(lambda _: Step.batch_spec(job.mesh), batch))
    compiled = job.train_step.compile(state, params, batch)
    return compiled_plan(f"train {cfg.drafter.name}", compiled, {
        "target params": params, "draft params": state["params"],
        "optimizer state": (state["opt_state"], state["step"]), "batch": batch}, mesh_devices(job.mesh), capacity,
        where, count_flops=True)


def _finished(cfg: TrainConfig) -> dict[str, Any] | None:
    """The summary of `out_dir` when it holds this run, trained to the end and saved; else None."""
    out = Path(cfg.out_dir)
    steps = saved_steps(out / "checkpoints")
    done = steps and steps[-1] >= cfg.loop.steps and (out / "heads" / META_FILE).is_file()
    return json.loads((out / "summary.json").read_text()) if done and (out / "summary.json").is_file() else None


def train_heads(cfg: TrainConfig, store_only: bool = False) -> dict[str, Any]:
    """Train `cfg`'s heads into `cfg.out_dir` (resuming what it holds of this run), under the directory's lock.
    With `store_only`, fill `data.hidden_store` with what this method's training reads (the target's hidden
    states, its captured layers and, with `loss.labels: target`, its top-k labels, for the train and held-out
    examples) and stop: the store's one command, reused by every later run over the same data and target."""
    maybe_initialize_distributed()
    enable_compile_cache(amphista_home())
    if store_only and not (cfg.data.cache_target_hidden and cfg.data.hidden_store):
        raise TrainConfigError("--store-only fills data.hidden_store: set data.cache_target_hidden=true and "
                               "data.hidden_store=DIR")
    found = preflight(cfg)  # every bad setting fails here, before anything is written
    if store_only:
        return _store(cfg, found)
    with output_lock(cfg.out_dir, "train") if jax.process_index() == 0 else contextlib.nullcontext():
        check_out_dir(cfg, found.identity)
        return _train(cfg, found)


def _prepare(cfg: TrainConfig, found: Preflight
             ) -> tuple[TrainJob, dict, ModelConfig, list[dict], list[dict], np.ndarray]:
    """The job (checked to fit), the target's params and config, the (train, held-out) examples, with the target's
    states attached from `data.hidden_store` (computed into it where missing) under `data.cache_target_hidden`, and
    the train examples' `trained_lengths`."""
    model_dir, target_config = found.model_dir, found.target_config
    tok = load_tokenizer(model_dir)
    train_examples, heldout = example_source(cfg.data).split(tok)
    lengths = trained_lengths(train_examples)  # before the states ride along
    if (grouped := cfg.data.length_groups * cfg.data.batch_size) > len(train_examples):
        raise DataError(f"data.length_groups={cfg.data.length_groups} batches of {cfg.data.batch_size} ({grouped} "
                        f"examples) exceed the {len(train_examples)} training examples: lower data.length_groups")
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
        store, target = cfg.data.hidden_store, found.identity["target"]
        captures = job.drafter.captured_layers(target_config)
        top_k = cfg.label_store_top_k
        train_examples, heldout = (
            with_hidden(examples, job.model, target_params, cfg.data.batch_size, store, target, captures, top_k,
                        cfg.data.store_layers) for examples in (train_examples, heldout))
    return job, target_params, target_config, train_examples, heldout, lengths


def train_dataset(examples: Sequence[dict[str, np.ndarray]], lengths: np.ndarray, data_cfg: DataConfig,
                  rows: slice) -> grain.MapDataset:
    """The training batches `data_cfg` asks for (this process's `rows` of each), grouped by the examples' `lengths`
    (`trained_lengths`) or not."""
    if data_cfg.length_groups:
        return length_grouped_dataset(examples, lengths, data_cfg.max_len, data_cfg.batch_size, data_cfg.seed,
                                      data_cfg.length_groups, rows)
    return example_dataset(examples, data_cfg.batch_size, data_cfg.seed, rows)


def _store(cfg: TrainConfig, found: Preflight) -> dict[str, Any]:
    """`train_heads(store_only=True)`: the store filled, its files and sizes printed and returned."""
    _, _, _, train_examples, heldout, _ = _prepare(cfg, found)
    store = Path(cfg.data.hidden_store)
    files = {p.name: p.stat().st_size for p in sorted(store.glob("*.npy"))}
    print(f"{store}: {len(train_examples)} train / {len(heldout)} held-out examples of {cfg.data.max_len} tokens; "
          f"{len(files)} files, {sum(files.values()) / GIB:.2f} GiB")
    return {"store": str(store), "train_examples": len(train_examples), "heldout_examples": len(heldout),
            "files": files}


def _train(cfg: TrainConfig, found: Preflight) -> dict[str, Any]:
    if (summary := _finished(cfg)) is not None:
        print(f"{cfg.out_dir} is already trained ({summary['steps']} steps with these settings, target and data): "
              f"its heads are in {Path(cfg.out_dir) / 'heads'}; nothing was changed (use a new out_dir to train "
              "again)")
        return summary
    model_dir, identity = found.model_dir, found.identity
    job, target_params, target_config, train_examples, heldout, lengths = _prepare(cfg, found)
    drafter, train_step, eval_step = job.drafter, job.train_step, job.eval_step
    init_state = functools.partial(job.new_state, Target(target_config, target_params))  # made in place on shards

    rows = process_batch_rows(job.mesh, cfg.data.batch_size)  # this process's rows of every global batch
    heldout_batches = [jax.tree.map(lambda x: x[rows], b)
                       for b in batch_examples(heldout, cfg.data.batch_size, cfg.eval_batches)]

    def evaluate(state: dict[str, Any]) -> dict[str, float]:
        return mean_metrics([eval_step(state["params"], target_params, b) for b in heldout_batches])

    settings = dataclasses.asdict(drafter) | ({"draft_vocab": f"{n} tokens"} if (n := len(drafter.draft_vocab)) else {})
    print(f"target {model_dir}: {target_config.num_params:,} parameters; drafter {drafter.name} {settings}; "
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
        data=iter(train_dataset(train_examples, lengths, cfg.data, rows)), evaluate=evaluate,
        tokens_per_batch=cfg.data.batch_size * cfg.data.max_len, desc=f"train {drafter.name}")
    summary = {
        "method": drafter.name, "settings": dataclasses.asdict(drafter), "model": model_dir,
        "steps": extra["steps"], "tokens_seen": extra["tokens_seen"], "train_seconds": round(extra["train_seconds"], 1),
        "heldout_before": before, "heldout_after": extra["eval"],
    }
    save_draft(out_dir / "heads", drafter.name, drafter, state["params"], target_config,
               target_params=target_params)  # collective in orbax
    if jax.process_index() == 0:
        write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        plot_curve(out_dir)
    print(json.dumps({"heldout_before": before, "heldout_after": extra["eval"]}, indent=2))
    return summary


def plot_curve(run_dir: str | Path) -> Path:
    """`training_curve.png`: train loss and held-out per-head top-1 accuracy over steps."""
    plt = pyplot()
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
    return save_figure(fig, Path(run_dir) / "training_curve.png")
