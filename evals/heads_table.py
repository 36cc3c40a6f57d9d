"""The heads trained for SmolLM2 on the shared recipe: parameters, training budget and held-out accuracy per head.

    python -m amphista_jax.evals.heads_table runs/smollm2/{medusa,eagle,amphista,hydra,sar} > heads.md

Each argument is a training run directory (`amphista-jax train`'s out_dir: summary.json and heads/).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax

from amphista_jax.drafters.io import read_draft_meta
from amphista_jax.fetch import resolve_model
from amphista_jax.models.hf import load_config
from amphista_jax.models.llama import param_shapes
from amphista_jax.target import Target


def main() -> None:
    config = load_config(resolve_model("smollm2"))
    print("| run | method | parameters | fp32 MB | steps | tokens seen | train s | held-out top-1 per head (step) |")
    print("|---|---|---|---|---|---|---|---|")
    for run in map(Path, sys.argv[1:]):
        summary = json.loads((run / "summary.json").read_text())
        drafter = read_draft_meta(run / "heads").drafter
        shapes = jax.eval_shape(lambda p, d=drafter: d.init(jax.random.key(0), Target(config, p)),
                                param_shapes(config)[0])
        n = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
        after = summary["heldout_after"]
        heads = sorted({k.split("/")[0] for k in after if k.endswith("/top1")}, key=lambda h: int(h[4:]))
        top1 = " / ".join(f"{after[f'{h}/top1']:.3f}" for h in heads)
        print(f"| {run.name} | {summary['method']} | {n / 1e6:.1f}M | {n * 4 / 1e6:.0f} | {summary['steps']} | "
              f"{summary['tokens_seen'] / 1e6:.2f}M | {summary['train_seconds']:.0f} | {top1} |")


if __name__ == "__main__":
    main()
