"""An eval run's record in its `out_dir`: `run.json`, what `--replace` removes, and the note a resumed run prints.

`run.json` holds the settings that change a prompt's result (`RESULT_SETTINGS`), the sha256 identities of the
target, the heads and the dataset (`amphista_jax.infra.identity`), and each method's description. A rerun into the
same `out_dir` resumes only when all of them match (`check_run_file`); `--replace` discards the run's outputs
(`EVAL_OUTPUTS`, nothing else there) and starts over.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax

from amphista_jax.evals.config import EvalConfig
from amphista_jax.evals.methods import CHOSEN, Method
from amphista_jax.infra.errors import OutputExistsError
from amphista_jax.infra.identity import RunMismatchError, changes, sha256_file, target_identity
from amphista_jax.infra.output_lock import LOCK_FILE, write_atomic

# Settings that change what a prompt's result is; a rerun into the same out_dir must keep them.
# `heldout` / `heldout_batches` are here because head_accuracy.json is cached per method label.
RESULT_SETTINGS = ("model", "max_new_tokens", "temperature", "top_k", "top_p", "acceptance", "batch_size", "dtype",
                   "seed", "pad_multiple", "attention", "heldout", "heldout_batches")


# What an eval run writes into its out_dir: what `--replace` removes (nothing else there is touched; run.json,
# the mark of an eval run, last).
EVAL_OUTPUTS = ("results", "compile", "merged", "head_accuracy.json", "tree_stats.json", "summary.json", "report.md",
                "head_accuracy.png", "tau_by_category.png", "run.json")


def check_run_file(out_dir: Path, cfg: EvalConfig, model_dir: str, methods: list[Method],
                   dataset_path: Path | None = None, replace: bool = False) -> dict[str, Any]:
    """Compare with `run.json` of earlier runs into `out_dir` (resuming must not mix settings, nor results of
    a target, heads or dataset that changed under the same path; `replace` starts over instead); returns what
    `write_run_file` records."""
    path = out_dir / "run.json"
    dataset = {"kind": cfg.dataset.kind, "path": cfg.dataset.path, "chat": cfg.dataset.use_chat}
    if cfg.dataset.turns:  # what a prompt's record holds (recorded when set, so earlier runs of all turns resume)
        dataset["turns"] = cfg.dataset.turns
    if dataset_path is not None:
        dataset["sha256"] = sha256_file(dataset_path)
    values = {k: getattr(cfg, k) for k in RESULT_SETTINGS}
    settings = json.loads(json.dumps(  # as stored (tuples -> lists)
        {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in values.items()} | {
            "model": model_dir, "model_files": target_identity(model_dir), "dataset": dataset}))
    described = json.loads(json.dumps({m.label: m.describe() for m in methods}))  # as stored (tuples -> lists)
    if not path.is_file() and out_dir.is_dir() and any(p.name != LOCK_FILE for p in out_dir.iterdir()):
        raise OutputExistsError(f"out_dir {out_dir} holds files but no run.json, so it is not an eval run: pick a "
                                "new out_dir (eval writes report.md, summary.json, results/ ... into it)")
    try:
        previous = json.loads(path.read_text()) if path.is_file() else {"settings": settings, "methods": {}}
    except json.JSONDecodeError as e:
        raise RunMismatchError(f"{path} is not valid JSON (line {e.lineno}: {e.msg}): restore it, or use a new "
                               "out_dir") from None
    if not isinstance(previous, dict) or not isinstance(previous.get("settings"), dict):  # e.g. a train run's
        raise RunMismatchError(f"{path} is not an eval run record: restore it, or use a new out_dir")
    if replace:  # an eval run's directory: its results are discarded (`discard_run`)
        return {"settings": settings, "methods": described}
    changed = changes(previous.get("settings"), settings)
    for label, now in described.items():
        if label in previous.get("methods", {}):
            before = previous["methods"][label]
            if "tree" not in now:  # `auto` not chosen yet: its tree is compared once it is (`runner._evaluate`)
                before = {k: v for k, v in before.items() if k not in CHOSEN}
            changed |= changes(before, now, f"method {label}")
    if changed:
        raise RunMismatchError(f"{out_dir} holds results made with other settings or inputs (before, now): "
                               f"{_format_changes(changed)}; use a new out_dir, or pass --replace to discard those "
                               "results and evaluate with these")
    return {"settings": settings, "methods": previous.get("methods", {}) | described}


def _format_changes(changed: dict[str, tuple[Any, Any]], limit: int = 4) -> str:
    """`key: (before, now)` items with long values cut; the files of one checkpoint (`model_files`, a
    method's `heads_files`) as one item naming the first file that differs."""
    def short(v: Any) -> str:
        text = repr(v[:12] + "..." if isinstance(v, str) and len(v) == 64 else v)  # a sha256
        return text if len(text) <= 60 else text[:57] + "..."

    items, files = [], {}
    for k, (before, now) in changed.items():
        group = next((k[: k.index(g) + len(g)] for g in ("model_files.", "heads_files.") if g in k), None)
        if group:
            files.setdefault(group.rstrip(".").replace(".heads_files", " heads_files"), []).append(
                k.removeprefix(group))
        else:
            items.append(f"{k}: ({short(before)}, {short(now)})")
    items = [f"{g}: content changed ({len(n)} file(s) differ, e.g. {n[0]})" for g, n in files.items()] + items
    return "; ".join(items[:limit]) + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def write_run_file(out_dir: Path, run: dict[str, Any]) -> None:
    """Process 0 records this run's settings and methods; the caller waits first until every process has checked the
    old ones (a barrier)."""
    if jax.process_index() == 0:
        write_atomic(out_dir / "run.json", json.dumps(run, indent=2) + "\n")


def discard_run(out_dir: Path) -> None:
    """Remove an earlier eval run's outputs (`EVAL_OUTPUTS`) from `out_dir`; other files there stay."""
    for name in EVAL_OUTPUTS:
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def resume_note(out_dir: Path) -> str | None:
    """The line that says an earlier run into `out_dir` is resumed (None: nothing to resume)."""
    if not (out_dir / "run.json").is_file():
        return None
    done = sum(1 for p in (out_dir / "results").glob("*.jsonl") for line in p.read_text().splitlines() if line)
    state = "finished" if (out_dir / "summary.json").is_file() else "did not finish (killed?)"
    return (f"note: {out_dir} holds an eval run with these settings that {state}: resuming it ({done} prompt "
            "result(s) kept, only the missing ones run); pass --replace to start over")
