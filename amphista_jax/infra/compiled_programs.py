"""Compiled programs against the kernel's limit on memory mappings.

Every XLA:CPU executable holds a few memory mappings until its cache entry goes. A process that compiles many
programs (an evaluation of nine methods over a dozen prompt-length buckets, a test worker running half the suite)
passes the kernel's per-process limit (`vm.max_map_count`, 65530 by default), and LLVM's JIT then fails mid-compile
("Cannot allocate memory") and the process dies. `release_if_crowded` drops JAX's compiled programs once the
process holds more than a share of that limit; programs needed again are recompiled. Ahead-of-time compiled
programs (a `Generator`'s) are out of JAX's caches' reach: their owners pass a callable that drops them.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import jax


def memory_maps() -> tuple[int, int]:
    """(memory mappings of this process, the kernel's per-process limit); (0, 0) where /proc has neither."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return 0, 0


def release_if_crowded(*holders: Callable[[], None], share: float = 1 / 3) -> bool:
    """Clear JAX's compiled programs, and those `holders` keep (each call drops one holder's, e.g.
    `Generator.release_programs`), when this process holds more than `share` of its memory-mapping limit; True
    when it did."""
    used, limit = memory_maps()
    if used <= limit * share:
        return False
    for release in holders:
        release()
    jax.clear_caches()
    gc.collect()
    return True
