"""Per-head top-1 / top-5 accuracy of any drafter on held-out data, teacher-forced (Amphista, Figure 1).

Head k (0-based) at position t is scored against the held-out text's own token at t + 2 + k, with the
ground-truth prefix as input (teacher forcing), and against the target's own greedy token there (`agree`: the
figure that sets how many drafts the target accepts): exactly the `head{k}/top1` / `top5` / `agree` metrics the
drafter's `loss` reports, computed by the trainer's own eval step (`amphista_jax.train.step.make_steps`). The numbers
are means over full batches of `data_cfg.batch_size` examples (each batch's masked mean, then the mean
over batches); with the default packed held-out code split every position of every batch counts.

    from amphista_jax.evals.head_accuracy import head_accuracy, heldout_batches
    batches = heldout_batches(tokenizer, n_batches=4)  # the embedded target's held-out code
    acc = head_accuracy(Target(config, params), drafter, draft_params, batches)  # {0: {"top1": .., "top5": ..}}
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import optax

from amphista_jax.assets import default_model_dir
from amphista_jax.drafters.base import Drafter
from amphista_jax.models.llama import target_model
from amphista_jax.models.target import Target
from amphista_jax.train.config import DataConfig
from amphista_jax.train.examples import batch_examples, example_source
from amphista_jax.train.loop import mean_metrics
from amphista_jax.train.step import make_steps

_HEAD_METRIC = re.compile(r"^head(\d+)/(top1|top5|agree)$")


def heldout_batches(tokenizer: Any, data_cfg: DataConfig | None = None, n_batches: int = 4
                    ) -> list[dict[str, np.ndarray]]:
    """Up to `n_batches` full held-out batches `{"tokens", "loss_mask": [B, T]}` of `data_cfg` (default: the
    held-out split of the embedded target's own corpus, which neither it nor its shipped heads trained on)."""
    data_cfg = data_cfg or DataConfig(kind="stdlib", corpus=str(default_model_dir()))
    return batch_examples(example_source(data_cfg).heldout(tokenizer), data_cfg.batch_size, n_batches)


def head_accuracy(target: Target, drafter: Drafter, draft_params: Any, batches: list[dict[str, np.ndarray]]
                  ) -> dict[int, dict[str, float]]:
    """`{head k: {"top1": float, "top5": float, "agree": float}}` of `drafter` on `batches` (see the module
    docstring; `agree`: top-1 against the target's own greedy token there, where the drafter's loss reports it)."""
    if not batches:
        raise ValueError("head_accuracy needs at least one held-out batch")
    model = target_model(target.config, target.params)
    _, eval_step = make_steps(model, drafter, optax.identity())  # the train step is unused
    metrics = mean_metrics([eval_step(draft_params, target.params, b) for b in batches])
    out: dict[int, dict[str, float]] = {}
    for name, value in metrics.items():
        if m := _HEAD_METRIC.match(name):
            out.setdefault(int(m[1]), {})[m[2]] = value
    if not out:
        raise ValueError(f"{type(drafter).__name__}.loss reports no head{{k}}/top1 metrics (got {sorted(metrics)})")
    return dict(sorted(out.items()))
