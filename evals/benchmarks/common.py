"""What every benchmark script shares: median timing (`amphista_jax.timing`) and writing its table + JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from amphista_jax.timing import median_seconds

__all__ = ["median_seconds", "write_report"]


def write_report(out_dir: str | Path, name: str, data: Any, table: str) -> None:
    """Print the markdown `table`; write `name.json` and `name.md` under `out_dir`."""
    print(table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"{name}.md").write_text(table + "\n")
