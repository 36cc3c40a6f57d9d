"""Wall-clock timing of jitted work, shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def wall_times(fn: Callable[[], Any], runs: int) -> list[float]:
    """Wall times of `runs` calls of `fn()` (each blocked until ready), after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def median_seconds(fn: Callable[[], Any], runs: int) -> float:
    """Median wall time of `fn()` over `runs` calls, after one warm-up call."""
    return statistics.median(wall_times(fn, runs))
