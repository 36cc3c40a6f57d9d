"""The machine a measurement ran on. Step costs belong to it (acceptance belongs to the heads): the CPU model and the
vector extensions XLA:CPU's speed depends on, or the accelerator; cores and memory; the library's and JAX's
versions. Every results table names it (`Machine.describe`), and per-machine data is keyed by it (`Machine.key`)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path

import jax

# the CPU features that change how fast XLA:CPU runs a product (vector width, bf16/int8 dot instructions)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "asimd", "sve")


@dataclasses.dataclass(frozen=True)
class Machine:
    backend: str  # cpu / gpu / tpu
    device: str  # the accelerator's kind, or the CPU's model name
    isa: tuple[str, ...]  # which of ISA_FLAGS the CPU has
    cores: int  # CPU cores this process may use
    memory_gib: float
    library: str  # amphista-jax's version
    jax: str

    def describe(self) -> str:
        """One line for a results table, e.g. "cpu: AMD EPYC 7B13 (avx2, fma), 2 cores, 23.4 GiB; amphista-jax
        0.1.0, jax 0.10.2"."""
        isa = f" ({', '.join(self.isa)})" if self.isa else ""
        return (f"{self.backend}: {self.device}{isa}, {self.cores} cores, {self.memory_gib:.1f} GiB; "
                f"amphista-jax {self.library}, jax {self.jax}")

    def key(self) -> str:
        """A short digest of everything above: another machine, CPU feature set or version gives another key."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def cpu_model_and_isa(cpuinfo: str) -> tuple[str, tuple[str, ...]]:
    """(model name, ISA_FLAGS present) from the text of /proc/cpuinfo (x86 `model name` / `flags`, Arm `Features`)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() not in fields:
            fields[name.strip()] = value.strip()
    model = fields.get("model name") or fields.get("Model") or fields.get("CPU part") or platform.processor() or "?"
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return model, tuple(f for f in ISA_FLAGS if f in flags)


def cores() -> int:
    """CPU cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def memory_bytes() -> int:
    """The host's physical memory (0 where the system does not say)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0


def this_machine() -> Machine:
    """The machine this process runs on."""
    info = Path("/proc/cpuinfo")
    model, isa = cpu_model_and_isa(info.read_text() if info.is_file() else "")
    backend = jax.default_backend()
    device = model if backend == "cpu" else jax.devices()[0].device_kind
    return Machine(backend, device, isa if backend == "cpu" else (), cores(), round(memory_bytes() / 2**30, 1),
                   importlib.metadata.version("amphista-jax"), jax.__version__)
