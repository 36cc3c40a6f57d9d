"""What every benchmark script shares: median timing and writing its table + JSON."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax


def median_seconds(fn: Callable[[], Any], runs: int) -> float:
    """Median wall time of `fn()` (blocked until ready) over `runs` calls, after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_report(out_dir: str | Path, name: str, data: Any, table: str) -> None:
    """Print the markdown `table`; write `name.json` and `name.md` under `out_dir`."""
    print(table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"{name}.md").write_text(table + "\n")
