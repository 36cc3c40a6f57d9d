"""`amphista-jax plan --config ...`: per-device memory of train configs' training and decoding, and the train
step's FLOPs where XLA can count them, before launch.

The train step and the decode loop are compiled ahead of time, for each config's target and mesh, from abstract
shapes on emulated CPU devices: no weights are loaded and no data is read (`amphista_jax.engine.memory_plan`). The
target's shape comes from `model`'s config.json when the checkpoint is here, else from `target_shape`. The device
capacity comes from `--accelerator`, else the config's `accelerator`; a slice of it runs one process per
`devices_per_host` devices, and `data.batch_size` (the global batch) must split over them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.engine.memory_plan import MemoryPlan, accelerator_capacity, decode_plan, plan_table
from amphista_jax.infra.accelerators import Accelerator, get_accelerator
from amphista_jax.infra.errors import OutputExistsError, UserError, check_writable_dir
from amphista_jax.infra.output_lock import write_atomic
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.fetch import resolve_model
from amphista_jax.models.hf import DTYPES, load_config, param_dtype
from amphista_jax.models.shapes import known_target
from amphista_jax.train.config import TrainConfig, check_batch_split, check_positions, check_target_shape
from amphista_jax.train.heads import plan_training, train_job
from amphista_jax.trees.names import get_tree

DECODE_NEW_TOKENS = 256


class PlanError(UserError, ValueError):
    """A plan that cannot be made as asked."""


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """One config to plan, checked: its target's shape and dtype, devices and accelerator."""

    name: str
    cfg: TrainConfig
    target: ModelConfig
    source: str  # where the target's shape came from
    dtype: Any
    devices: int
    accelerator: Accelerator | None


def plan_request(name: str, cfg: TrainConfig, accelerator: Accelerator | None = None) -> PlanRequest:
    """Everything about `cfg` that can be checked without compiling: the target's shape (`model`'s config.json
    when present, checked against `target_shape`; else `target_shape`), its dtype, the batch split."""
    accelerator = accelerator or (get_accelerator(cfg.accelerator) if cfg.accelerator else None)
    model = resolve_model(cfg.model)  # the embedded model, a registry name (fetched on first use) or a path
    if (Path(model) / "config.json").is_file():
        target, source, dtype = load_config(model), f"{model}/config.json", param_dtype(model, cfg.dtype)
        if cfg.target_shape:
            check_target_shape(cfg.target_shape, target, model)
    elif cfg.target_shape:
        target, source, dtype = known_target(cfg.target_shape), f"target_shape {cfg.target_shape}", DTYPES[cfg.dtype]
    else:
        raise PlanError(f"{name}: model {cfg.model} has no config.json here: set target_shape (e.g. --set "
                        "target_shape=vicuna-7b) or point model at the checkpoint")
    if dtype is None:
        raise PlanError(f"{name}: dtype checkpoint, but the checkpoint is not here to say its dtype: set dtype (e.g. "
                        "--set dtype=bfloat16)")
    check_positions(cfg, target)
    devices = cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.tensor if cfg.mesh else 1
    check_batch_split(cfg)
    return PlanRequest(name, cfg, target, source, dtype, devices, accelerator)


def processes(devices: int, accelerator: Accelerator | None) -> int:
    return -(-devices // accelerator.devices_per_host) if accelerator else 1


def emulate_devices(count: int) -> list[jax.Device]:
    """`count` CPU devices to compile on: emulated when JAX is not started yet, else those it has."""
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # JAX already runs (a test, a notebook): use its CPU devices if there are enough
        pass
    devices = jax.devices("cpu")
    if len(devices) < count:
        raise PlanError(f"a mesh needs {count} devices but this process started JAX with {len(devices)} CPU "
                        "devices: run `amphista-jax plan` in a process of its own")
    return devices[:count]


def plan_config(req: PlanRequest, devices: list[jax.Device], decode_batch: int = 1,
                tree_name: str | None = None) -> tuple[list[MemoryPlan], dict]:
    """The train and decode plans of `req` on `devices` (its mesh's count), and what they were made for; the decode
    plan drafts `tree_name` (default: the method's tree in its paper)."""
    cfg, accelerator = req.cfg, req.accelerator
    job = train_job(cfg, req.target, devices[:req.devices])
    tree_name = tree_name or job.drafter.paper_tree
    capacity = accelerator_capacity(accelerator) if accelerator else (None, "")
    tree = get_tree(tree_name)
    spec = DecodeSpec(req.target, job.drafter, tree, DECODE_NEW_TOKENS)
    prompt_len = min(cfg.data.max_len, req.target.max_positions - spec.cache_size(0))  # what the positions leave
    if prompt_len < 1:
        raise PlanError(f"{req.name}: the target's {req.target.max_positions} positions leave no room for a prompt "
                        f"besides {DECODE_NEW_TOKENS} new tokens and tree {tree_name}: plan a smaller --tree")
    plans = [plan_training(cfg, job, req.dtype, *capacity),
             decode_plan(req.target, job.drafter, tree, job.mesh, req.dtype, decode_batch, prompt_len,
                         DECODE_NEW_TOKENS, *capacity)]
    setup = {"config": req.name, "target": req.source, "params": req.target.num_params, "method": cfg.drafter.name,
             "dtype": str(jax.numpy.dtype(req.dtype)), "mesh": dataclasses.asdict(cfg.mesh) if cfg.mesh else None,
             "devices": req.devices, "processes": processes(req.devices, accelerator),
             "batch": cfg.data.batch_size, "microbatches": cfg.data.microbatches, "max_len": cfg.data.max_len,
             "accelerator": accelerator.name if accelerator else None,
             "decode": {"batch": decode_batch, "prompt_len": prompt_len, "new_tokens": DECODE_NEW_TOKENS,
                        "tree": tree_name, "nodes": tree.num_nodes}}
    return plans, setup


def plan_configs(requests: list[PlanRequest], decode_batch: int = 1, tree_name: str | None = None
                 ) -> list[tuple[list[MemoryPlan], dict]]:
    devices = emulate_devices(max(r.devices for r in requests))
    return [plan_config(r, devices, decode_batch, tree_name) for r in tqdm(requests, desc="plan", unit="config",
                                                                            disable=len(requests) == 1)]


def describe(results: list[tuple[list[MemoryPlan], dict]]) -> str:
    """The plans as printed and written: what each is for, one table, the verdicts."""
    lines = ["Memory plan per device, compiled on emulated CPU devices from abstract shapes: arguments exact, "
             "temporaries as XLA:CPU assigns them (it computes bf16 products through fp32 copies, so they are on "
             "the high side for bf16 targets). GFLOP: XLA's count of one train step on one device, shown where the "
             "step has no loop that multiplies (a scanned layer stack or microbatch loop would count once).", ""]
    for _, s in results:
        dec = s["decode"]
        lines.append(f"- {s['config']}: {s['method']} on {s['target']} ({s['params'] / 1e9:.2f}B parameters, "
                     f"{s['dtype']}), mesh {s['mesh'] or 'one device'} ({s['processes']} process(es)); train: batch "
                     f"{s['batch']} x {s['max_len']} tokens in {s['microbatches']} microbatch(es); decode: batch "
                     f"{dec['batch']}, {dec['prompt_len']} prompt + {dec['new_tokens']} new tokens, tree {dec['tree']} "
                     f"({dec['nodes']} nodes)")
    plans = [p for plans, _ in results for p in plans]
    names = [s["config"] for plans, s in results for _ in plans]
    lines += ["", plan_table(plans, names), ""]
    lines += [f"- {name} {p.job}: {p.verdict()}" for name, p in zip(names, plans, strict=True)]
    return "\n".join(lines)


PLAN_FILES = ("plan.json", "plan.md")


def check_plan_out(out: Path, replace: bool) -> None:
    """Before any compile: `out` must be a directory we can write, without plans of an earlier run unless
    `replace`."""
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"--out {out} is a file: plan writes plan.json and plan.md into a directory; pick "
                                "a directory")
    if (taken := [n for n in PLAN_FILES if (out / n).exists()]) and not replace:
        raise OutputExistsError(f"--out {out} already holds {', '.join(taken)}: pass --replace to overwrite them, or "
                                "pick another directory")
    check_writable_dir(out, "--out")


def write_plans(results: list[tuple[list[MemoryPlan], dict]], out: Path) -> None:
    """`plan.json` and `plan.md` in `out` (made if missing; other files there are left alone)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"setup": setup, "plans": [dataclasses.asdict(p) | {"total": p.total, "fits": p.fits} for p in plans]}
            for plans, setup in results]
    write_atomic(out / "plan.json", json.dumps(rows, indent=2) + "\n")
    write_atomic(out / "plan.md", describe(results) + "\n")
