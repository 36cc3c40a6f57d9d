"""The heads trained for SmolLM2 on the shared recipe: parameters, training budget and held-out accuracy per head.

    python -m amphista_jax.evals.heads_table runs/smollm2/{medusa,eagle,amphista,hydra,sar} > heads.md
    python -m amphista_jax.evals.heads_table --shipped > agreement.md

Each argument is a training run directory (`amphista-jax train`'s out_dir: summary.json and heads/). `--shipped`
measures every head set shipped for SmolLM2 on the recipe's held-out ShareGPT conversations (`configs/base/
smollm2-cpu.yaml`, teacher-forced): each head's top-1 against ShareGPT's next token (the data label it trained on)
beside its agreement with the target's own greedy token there (what the target accepts).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax

from amphista_jax.facade.drafter_source import read_source
from amphista_jax.models.fetch import resolve_model
from amphista_jax.models.hf import load_config
from amphista_jax.models.llama import param_shapes
from amphista_jax.models.target import Target

RECIPE = "configs/base/smollm2-cpu.yaml"
HELDOUT_BATCHES = 4


def shipped_agreement() -> str:
    """The `--shipped` table (see the module docstring)."""
    import dataclasses

    from amphista_jax.assets import shipped_heads, shipped_heads_dir
    from amphista_jax.drafters.io import load_draft
    from amphista_jax.evals.head_accuracy import head_accuracy, heldout_batches
    from amphista_jax.infra.config_io import load_config as load_yaml
    from amphista_jax.infra.machine import this_machine
    from amphista_jax.models.hf import load_params
    from amphista_jax.models.tokenizer import load_tokenizer
    from amphista_jax.train.config import TrainConfig

    model = resolve_model("smollm2")
    params, config = load_params(model, dtype="float32")
    data = dataclasses.replace(load_yaml(TrainConfig, RECIPE).data, cache_target_hidden=False)
    batches = heldout_batches(load_tokenizer(model), data, HELDOUT_BATCHES)
    rows = [f"Held-out ShareGPT conversations of `{RECIPE}` ({len(batches)} batches of {data.batch_size} x "
            f"{data.max_len} tokens, teacher-forced); {this_machine().describe()}. Command: `python -m "
            "amphista_jax.evals.heads_table --shipped`.", "",
            "| head set | method | top-1 vs ShareGPT's token, per head | agreement with the target's greedy token, "
            "per head |", "|---|---|---|---|"]
    for name in shipped_heads("smollm2"):
        method, drafter, draft_params = load_draft(shipped_heads_dir(name, "smollm2"), config, params)
        acc = head_accuracy(Target(config, params), drafter, draft_params, batches)
        cells = [" / ".join(f"{a[m]:.3f}" for a in acc.values()) if all(m in a for a in acc.values()) else "-"
                 for m in ("top1", "agree")]
        rows.append(f"| {name} | {method} | {cells[0]} | {cells[1]} |")
    return "\n".join(rows)


def main() -> None:
    if sys.argv[1:] == ["--shipped"]:
        print(shipped_agreement())
        return
    config = load_config(resolve_model("smollm2"))
    print("| run | method | parameters | fp32 MB | steps | tokens seen | train s | held-out top-1 per head (step) |")
    print("|---|---|---|---|---|---|---|---|")
    for run in map(Path, sys.argv[1:]):
        summary = json.loads((run / "summary.json").read_text())
        drafter = read_source(run / "heads", None, None).drafter
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
