"""What every benchmark script shares: its common options, the target it loads, median timing
(`amphista_jax.timing`) and writing its table + JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from amphista_jax.assets import default_model_dir
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.hf import load_params
from amphista_jax.timing import median_seconds

__all__ = ["benchmark_parser", "load_target", "median_seconds", "write_report"]


def benchmark_parser(doc: str, runs: int | None = None) -> argparse.ArgumentParser:
    """A parser with the options benchmarks share: `--model` (default: the embedded target), `--out` and,
    given a default, `--runs`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    if runs is not None:
        parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--out", default="runs/benchmarks")
    return parser


def load_target(model: str | None) -> tuple[str, dict, ModelConfig]:
    """(directory, fp32 params, config) of `--model`, or of the embedded target when it is not given."""
    model = model or str(default_model_dir())
    params, config = load_params(model, dtype="float32")
    return model, params, config


def write_report(out_dir: str | Path, name: str, data: Any, table: str) -> None:
    """Print the markdown `table`; write `name.json` and `name.md` under `out_dir`."""
    print(table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / f"{name}.md").write_text(table + "\n")
