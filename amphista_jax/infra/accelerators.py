"""Named accelerators: the vendors' data-sheet figures that plans and roofline predictions are checked against."""

from __future__ import annotations

import dataclasses
import os

from amphista_jax.infra.errors import UserError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    bandwidth: float  # HBM bytes/s
    memory: int  # HBM bytes per device (one JAX device: a GPU, a TPU chip)
    devices_per_host: int  # devices one process drives in a multi-host slice
    platform: str  # "gpu" or "tpu"

    @property
    def usable_memory(self) -> int:
        """The bytes XLA may allocate on one device: all of a TPU's HBM; on a GPU, JAX preallocates
        `XLA_PYTHON_CLIENT_MEM_FRACTION` (default 0.75) of it and XLA works inside that pool (read here from this
        process's environment: set it as the job will)."""
        if self.platform == "tpu":
            return self.memory
        return int(self.memory * float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")))

    def seconds(self, flops: float, bytes_accessed: float) -> float:
        return max(flops / self.peak_flops, bytes_accessed / self.bandwidth)

    def bound(self, flops: float, bytes_accessed: float) -> str:
        return "compute" if flops / self.peak_flops > bytes_accessed / self.bandwidth else "memory"


# Vendors' data sheets: dense (no sparsity) bf16 peak, HBM bandwidth and capacity (GPUs: the capacity the
# driver reports, e.g. 81559 MiB for an H100 SXM).
ACCELERATORS = {a.name: a for a in (
    Accelerator("H100-SXM", 989e12, 3.35e12, 81559 << 20, 8, "gpu"),
    Accelerator("H200", 989e12, 4.8e12, 143771 << 20, 8, "gpu"),
    Accelerator("A100-80GB", 312e12, 2.039e12, 81920 << 20, 8, "gpu"),
    Accelerator("TPU-v4", 275e12, 1.2e12, 32 * GIB, 4, "tpu"),
    Accelerator("TPU-v5e", 197e12, 0.819e12, 16 * GIB, 4, "tpu"),
    Accelerator("TPU-v5p", 459e12, 2.765e12, 95 * GIB, 4, "tpu"),
    Accelerator("TPU-v6e", 918e12, 1.64e12, 32 * GIB, 4, "tpu"),
)}


class UnknownAcceleratorError(UserError, ValueError):
    """An accelerator name this library has no data for."""


def get_accelerator(name: str) -> Accelerator:
    if name not in ACCELERATORS:
        raise UnknownAcceleratorError(f"accelerator {name!r} is not known; known: {', '.join(ACCELERATORS)}")
    return ACCELERATORS[name]
