"""How the tree-attention kernel is launched: its block sizes and splits (`KernelSettings`), the compiler each
platform runs it with, and what the GPU compiler accepts (`check_gpu_head_dim`). Nothing here computes attention
(`tree_attention.py` does)."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pl_triton


@dataclass(frozen=True)
class KernelSettings:
    """Block sizes and launch settings of the Pallas kernel, checked when made.

    block_k: committed cache slots per online-softmax step (a power of two >= 16 for compiled GPU kernels, Triton's
    smallest dot). k_splits: programs that share one (batch row, kv head)'s committed prefix, each over a
    contiguous run of blocks, merged afterwards (flash-decoding); None picks enough splits for `min_programs`
    programs on a GPU and 1 elsewhere (a TPU core runs programs one after another; interpreted, splits only cost).
    num_warps, num_stages: Triton's launch settings (GPU only).
    """

    block_k: int = 128
    k_splits: int | None = None
    min_programs: int = 132  # an H100 has 132 SMs
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_k", "min_programs", "num_warps", "num_stages"):
            _check_positive(name, getattr(self, name))
        if self.k_splits is not None:
            _check_positive("k_splits", self.k_splits)

    def block_size(self, num_slots: int, platform: str) -> int:
        """The committed-slot block of one online-softmax step for a cache of `num_slots`: `block_k`, at most S;
        on GPU a power of two >= 16 (Triton's tile shapes), the largest one within S."""
        if platform != "gpu":
            return min(self.block_k, num_slots)
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k={self.block_k} must be a power of two >= 16 for the compiled GPU kernel")
        if num_slots < 16:
            raise ValueError(f"a cache of {num_slots} slots is below the GPU kernel's smallest block (16): use the "
                             "xla backend for caches this small")
        return min(self.block_k, 1 << (num_slots.bit_length() - 1))

    def splits(self, num_slots: int, programs: int, platform: str) -> tuple[int, int]:
        """(k_splits, committed blocks per split) for a cache of `num_slots` and `programs` = batch * kv heads; the
        automatic choice aims at `min_programs` programs, fewer where the blocks do not divide evenly."""
        num_blocks = pl.cdiv(num_slots, self.block_size(num_slots, platform))
        wanted = self.k_splits or (pl.cdiv(self.min_programs, programs) if platform == "gpu" else 1)
        per_split = pl.cdiv(num_blocks, min(wanted, num_blocks))
        return pl.cdiv(num_blocks, per_split), per_split


def check_gpu_head_dim(head_dim: int, dtype: jnp.dtype) -> None:
    """Raise ValueError where Triton's dot cannot take the head dimension: a 16-bit dot contracts over >= 16
    elements (a smaller 16-bit head_dim compiles to wrong scores: docs/gpu/README.md)."""
    if jnp.dtype(dtype).itemsize < 4 and head_dim < 16:
        raise ValueError(f"head_dim={head_dim} in {jnp.dtype(dtype).name} is below the GPU kernel's smallest "
                         "16-bit dot (16): use the xla backend, or float32")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def compiler_params(platform: str, settings: KernelSettings) -> pl.CompilerParams | None:
    """The compiler each platform runs: Triton on GPU, Mosaic on TPU (every grid axis independent)."""
    if platform == "gpu":
        return pl_triton.CompilerParams(num_warps=settings.num_warps, num_stages=settings.num_stages)
    if platform == "tpu":
        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
    return None
