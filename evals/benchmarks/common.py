"""What every benchmark script shares: its common options, the target it loads, median timing
(`amphista_jax.infra.timing`) and writing its table + JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import jax

from amphista_jax.infra.machine import this_machine
from amphista_jax.infra.output_lock import write_atomic
from amphista_jax.infra.timing import median_seconds
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.fetch import resolve_model
from amphista_jax.models.hf import load_params
from amphista_jax.models.llama import init_params
from amphista_jax.models.param_layout import split_layers

__all__ = ["SIZES", "benchmark_parser", "load_target", "median_seconds", "model_config", "nbytes", "random_target",
           "write_report"]

SIZES = {  # name -> transformers LlamaConfig kwargs
    "20m": dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4),
    "150m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2304, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
    "500m": dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
                 num_attention_heads=12, num_key_value_heads=4),
}


def model_config(size: str) -> ModelConfig:
    """Our config for one of `SIZES` (transformers' LlamaConfig names)."""
    hf = SIZES[size]
    return ModelConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                       intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
                       num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                       head_dim=hf["hidden_size"] // hf["num_attention_heads"])


def nbytes(tree: Any) -> int:
    """Bytes of a tree of arrays."""
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def random_target(config: ModelConfig, dtype: str = "float32") -> dict:
    """Random-init `dtype` params of `config`, in decoding's `split_layers` layout."""
    return split_layers(jax.tree.map(lambda x: x.astype(dtype), init_params(config, jax.random.key(0))))


def benchmark_parser(doc: str, runs: int | None = None) -> argparse.ArgumentParser:
    """A parser with the options benchmarks share: `--model` (default: the embedded target), `--out` and,
    given a default, `--runs`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    if runs is not None:
        parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--out", default="runs/benchmarks")
    return parser


def load_target(model: str | None, layout: str = "split") -> tuple[str, dict, ModelConfig]:
    """(directory, fp32 params in `layout` (`hf.LAYOUTS`; decoding's by default), config) of `--model` (a path or a
    registry name, `smollm2`, fetched on first use), or of the embedded target when it is not given."""
    model = resolve_model(model)
    params, config = load_params(model, dtype="float32", layout=layout)
    return model, params, config


def write_report(out_dir: str | Path, name: str, data: Any, table: str) -> None:
    """Print the markdown `table` under a line naming the machine it ran on; write `name.json` (`data`, with the
    machine under `machine` when `data` is a dict) and `name.md` under `out_dir`."""
    machine = this_machine()
    table = f"Machine: {machine.describe()}\n\n{table}"
    if isinstance(data, dict):
        data = data | {"machine": dataclasses.asdict(machine)}
    print(table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / f"{name}.json", json.dumps(data, indent=2) + "\n")
    write_atomic(out / f"{name}.md", table + "\n")
