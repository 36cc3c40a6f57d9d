"""Memory plans: the bytes a jitted job needs on each device, known before any weight is loaded.

A plan compiles the job's real jitted function ahead of time. Its arguments are `jax.ShapeDtypeStruct`s that
carry the shardings the job gives its arrays. The plan then reads the compiled program's buffer assignment
(`Compiled.memory_analysis()`). For one device it gives:
- the arguments, split into the job's named parts (target params, draft params, optimizer state, batch), each
  counted from its shard shapes;
- the outputs that do not reuse a donated argument's buffer;
- the temporaries: activations, gradients, KV caches built inside the program, and workspaces.

With emulated CPU devices (`--xla_force_host_platform_device_count`, `jax_num_cpu_devices`) the partitioned
program is the one a pod runs. The argument bytes are exact. The temporaries follow XLA:CPU's fusion and buffer
reuse, which differ from a TPU's or GPU's compiler, so they are an estimate on CPU and exact on the accelerator
itself (where `train` prints the plan of the program it runs).

A train step's plan also gives its FLOPs on one device, XLA's cost analysis of the compiled step, when the step
has no loop that multiplies (`loop_free_flops`): steps on stored target states with unrolled drafters, the runs
whose training compute methods are compared by.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from amphista_jax.drafters.base import Drafter
from amphista_jax.engine.decode import decode
from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.engine.sharding import batch_sharding, draft_param_shardings, on_mesh, param_shardings
from amphista_jax.infra.accelerators import GIB, Accelerator
from amphista_jax.infra.hlo import HloModule
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import param_shapes
from amphista_jax.models.target import Target
from amphista_jax.trees.tree import Tree


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of arrays / `jax.ShapeDtypeStruct`s: each leaf's shard, or all of it when
    it carries no sharding."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def abstract(tree: Any, shardings: Any = None) -> Any:
    """`jax.ShapeDtypeStruct`s of `tree` (arrays or structs), placed by the matching tree of `shardings`."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one compiled job."""

    job: str
    devices: int
    inputs: dict[str, int]  # named argument groups
    outputs: int  # outputs not written over a donated argument
    temp: int
    code: int
    capacity: int | None = None  # bytes XLA may use on one device; None: unknown
    where: str = ""  # what `capacity` is ("TPU-v5p", "cuda:0 bytes_limit")
    flops: float | None = None  # one run of the program on one device, as XLA counts it; None: not counted

    @property
    def total(self) -> int:
        return sum(self.inputs.values()) + self.outputs + self.temp + self.code

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.total <= self.capacity

    def verdict(self) -> str:
        if self.capacity is None:
            return "no device capacity known: name an accelerator to check the fit"
        word = "fits" if self.fits else "does NOT fit"
        return (f"{word}: {self.total / GIB:.2f} of {self.capacity / GIB:.2f} GiB per device on {self.where} "
                f"({100 * self.total / self.capacity:.0f}%)")


def compiled_cost(compiled: jax.stages.Compiled) -> dict[str, float]:
    """{"flops", "bytes"} of one run of `compiled` on one device, from XLA's cost analysis of the program (a loop's
    body is counted once, whatever its trip count); empty where the backend gives no analysis."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):  # one entry per program in older jax versions
        analysis = analysis[0] if analysis else None
    names = {"flops": "flops", "bytes": "bytes accessed"}
    return {k: float(analysis[name]) for k, name in names.items() if analysis and name in analysis}


def loop_free_flops(compiled: jax.stages.Compiled) -> float | None:
    """XLA's FLOP count of one run of `compiled` on one device, unless a loop of the optimised program multiplies (a
    scanned layer stack, a microbatch scan: their bodies would count once); None too without an analysis."""
    hlo = HloModule(compiled.as_text())
    loops_multiply = any(hlo.multiplies(body) for body in {ins.called("body") for _, ins in hlo.loops.values()})
    return None if loops_multiply else compiled_cost(compiled).get("flops")


def compiled_plan(job: str, compiled: jax.stages.Compiled, inputs: Mapping[str, Any], devices: int,
                  capacity: int | None = None, where: str = "", count_flops: bool = False) -> MemoryPlan:
    """The plan of `compiled`, whose arguments are the trees in `inputs` (named, in order). Argument bytes XLA
    counts beyond the named parts' shard bytes (a device layout's tile padding) are the part "layout padding".
    `count_flops`: also the program's FLOPs (`loop_free_flops`)."""
    stats = compiled.memory_analysis()
    parts = {name: device_bytes(tree) for name, tree in inputs.items()}
    if padding := stats.argument_size_in_bytes - sum(parts.values()):
        parts["layout padding"] = padding
    return MemoryPlan(job, devices, parts, stats.output_size_in_bytes - stats.alias_size_in_bytes,
                      stats.temp_size_in_bytes, stats.generated_code_size_in_bytes, capacity, where,
                      loop_free_flops(compiled) if count_flops else None)


def accelerator_capacity(accelerator: Accelerator | None) -> tuple[int | None, str]:
    """(bytes XLA may use per device, what that is): the named accelerator's, else this process's first
    local device's allocator limit when it reports one (GPUs, TPUs), else unknown."""
    if accelerator is not None:
        return accelerator.usable_memory, accelerator.name
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"{device.device_kind} (bytes_limit)"
    return None, ""


def mesh_devices(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.devices.size


def decode_plan(config: ModelConfig, drafter: Drafter, tree: Tree, mesh: Mesh | None, dtype: Any, batch: int,
                prompt_len: int, max_new_tokens: int, capacity: int | None = None, where: str = "") -> MemoryPlan:
    """The memory plan of `speculative_generate` (prefill and the whole decode loop, KV caches included) for
    `batch` prompts of `prompt_len` tokens: the target in decoding's per-layer layout (`dtype`), the drafter's
    freshly initialised params, both sharded over `mesh` as `on_mesh` decodes."""
    params = param_shapes(config, dtype, split=True)[0]
    draft = jax.eval_shape(lambda p: drafter.init(jax.random.key(0), Target(config, p)), params)
    if mesh is not None:
        params = abstract(params, param_shardings(config, mesh, split=True))
        draft = abstract(draft, draft_param_shardings(drafter, Target(config, params), mesh))
    prompt = {"tokens": jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32),
              "lengths": jax.ShapeDtypeStruct((batch,), jnp.int32),
              "rng": jax.eval_shape(lambda: jax.random.key(0))}
    if mesh is not None:  # rows over the batch axes
        prompt = abstract(prompt, {"tokens": batch_sharding(mesh, (batch, prompt_len)),
                                   "lengths": batch_sharding(mesh, (batch,)), "rng": NamedSharding(mesh, P())})
    with on_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        spec = DecodeSpec(config, drafter, tree, max_new_tokens)
        compiled = decode.lower(params, draft, prompt["tokens"], prompt["lengths"], prompt["rng"], spec=spec,
                                cache_size=spec.cache_size(prompt_len)).compile()
    return compiled_plan("decode", compiled, {"target params": params, "draft params": draft, "batch": prompt},
                         mesh_devices(mesh), capacity, where)


def plan_table(plans: list[MemoryPlan], names: list[str] | None = None) -> str:
    """A markdown table of `plans` per device, one row each (GiB; MiB when every plan is under 1 GiB), with a
    first column of `names` when given and a last of GFLOP when any plan counted them."""
    unit, scale = ("GiB", GIB) if max(p.total for p in plans) >= GIB else ("MiB", 1 << 20)
    parts = list(dict.fromkeys(name for p in plans for name in p.inputs))
    flops = any(p.flops is not None for p in plans)
    head = (f"| {'config | ' if names else ''}job | devices | {' | '.join(parts)} | outputs | temporaries | "
            f"code | total {unit} | capacity {unit} | fits |{' GFLOP |' if flops else ''}")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, p in enumerate(plans):
        cells = " | ".join(f"{p.inputs[n] / scale:.2f}" if n in p.inputs else "-" for n in parts)
        cap = f"{p.capacity / scale:.1f} ({p.where})" if p.capacity else "-"
        fits = {True: "yes", False: "**no**", None: "-"}[p.fits]
        gflop = f" {'-' if p.flops is None else f'{p.flops / 1e9:.3g}'} |" if flops else ""
        lines.append(f"| {f'{names[i]} | ' if names else ''}{p.job} | {p.devices} | {cells} | "
                     f"{p.outputs / scale:.2f} | {p.temp / scale:.2f} | {p.code / scale:.2f} | {p.total / scale:.2f} | "
                     f"{cap} | {fits} |{gflop}")
    return "\n".join(lines)
