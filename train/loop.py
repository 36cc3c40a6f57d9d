"""The training loop shared by every trainer (draft heads, the embedded target's pre-training).

It owns what must never lose a user's work: orbax checkpoints of (state, data-iterator state, counters)
every `checkpoint_every` steps and at the end, exact resume from the latest one, SIGTERM / preemption ->
save and exit with status 143, a NaN/Inf loss -> stop naming the step. It also shows a progress bar
(loss, accuracy, tokens/s), runs periodic held-out evaluation, and appends metrics to `metrics.jsonl`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from amphista_jax.infra.errors import OutputExistsError
from amphista_jax.infra.output_lock import write_atomic
from amphista_jax.infra.ranges import check_ranges, setting
from amphista_jax.train.checkpoint import Checkpointer, saved_steps

PREEMPTED_EXIT = 143


class Preempted(SystemExit):
    """Raised after a SIGTERM-triggered checkpoint; rerunning the same command resumes."""

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT)
        self.step = step


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    steps: int = setting(1000, ge=1)
    checkpoint_every: int = setting(100, ge=1)
    keep_checkpoints: int = setting(3, ge=1, why="a run keeps at least its latest checkpoint to resume from")
    eval_every: int = setting(0, ge=0, why="0 = only at the end")
    log_every: int = setting(10, ge=1)

    def __post_init__(self) -> None:
        check_ranges(self)


def maybe_initialize_distributed() -> None:
    """`jax.distributed.initialize()` when the environment describes a multi-process job."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and not jax.distributed.is_initialized():
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )


def run_loop(
    *,
    run_dir: str | Path,
    cfg: LoopConfig,
    init_state: Callable[[], Any],
    train_step: Callable[[Any, Any], tuple[Any, dict[str, jax.Array]]],
    data: Iterator[Any],
    tokens_per_batch: int,
    evaluate: Callable[[Any], dict[str, float]] | None = None,
    desc: str = "train",
) -> tuple[Any, dict[str, Any]]:
    """Train from the latest checkpoint in `run_dir/checkpoints` (or `init_state()`) up to `cfg.steps`.

    `train_step(state, batch) -> (state, metrics)` must return a `"loss"` metric; `data` is a grain
    iterator (with `get_state` / `set_state`). Returns (final state, counters: tokens_seen, train_seconds,
    steps, last metrics, last eval).
    """
    run_dir = Path(run_dir)
    check_no_foreign_log(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.keep_checkpoints, every=cfg.checkpoint_every)
    extra: dict[str, Any] = {"tokens_seen": 0, "train_seconds": 0.0}
    if ckpt.latest_step() is not None:
        state, extra = ckpt.restore(jax.eval_shape(init_state))
        data.set_state(extra.pop("data"))
        step = ckpt.latest_step()
        print(f"resumed from step {step} in {ckpt.directory}")
        _truncate_metrics(run_dir, step)
    else:
        state, step = init_state(), 0
    log = (run_dir / "metrics.jsonl").open("a") if jax.process_index() == 0 else None
    stop: dict[str, int | None] = {"signal": None}
    previous = signal.signal(signal.SIGTERM, lambda s, f: stop.update(signal=s))
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, unit="step", dynamic_ncols=True,
               disable=jax.process_index() != 0)
    last: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    discard_log = False

    def save(force: bool) -> None:
        ckpt.save(step, state, extra | {"data": data.get_state()}, force=force)

    try:
        while step < cfg.steps and stop["signal"] is None:
            t0 = time.perf_counter()
            state, metrics = train_step(state, next(data))
            last = {k: float(v) for k, v in metrics.items()}
            seconds = time.perf_counter() - t0
            if not math.isfinite(last["loss"]):
                raise FloatingPointError(
                    f"loss became {last['loss']} at step {step + 1}; the last good checkpoint is step "
                    f"{ckpt.latest_step()} in {ckpt.directory}: lower the learning rate or check the data")
            step += 1
            extra["tokens_seen"] += tokens_per_batch
            extra["train_seconds"] += seconds
            bar.update(1)
            bar.set_postfix({k: f"{v:.3f}" for k, v in last.items() if k in ("loss", "head0/top1")}
                            | {"tok/s": f"{tokens_per_batch / seconds:.0f}"})
            record = {"step": step, "tokens_per_s": tokens_per_batch / seconds} | last
            if evaluate is not None and cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                last_eval = evaluate(state)
                record |= {f"eval/{k}": v for k, v in last_eval.items()}
            if log is not None and (step % cfg.log_every == 0 or step == cfg.steps or "eval/loss" in record):
                log.write(json.dumps(record) + "\n")
                log.flush()
            save(force=step == cfg.steps)
    except BaseException:
        ckpt.close(check=False)  # let a pending save finish; the error being raised is the one to report
        # A start that never completed a checkpoint leaves no metric rows: a rerun starts over, on a clean log.
        discard_log = log is not None and not saved_steps(ckpt.directory)
        raise
    finally:
        bar.close()
        signal.signal(signal.SIGTERM, previous)
        if log is not None:
            log.close()
            if discard_log:
                (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    if stop["signal"] is not None:
        save(force=True)
        ckpt.close()
        print(f"stopped by signal at step {step}; checkpoint saved, rerun the same command to resume")
        raise Preempted(step)
    ckpt.close()
    if evaluate is not None:
        last_eval = evaluate(state)
        if log is not None:
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"step": step} | {f"eval/{k}": v for k, v in last_eval.items()}) + "\n")
    return state, extra | {"steps": step, "last_metrics": last, "eval": last_eval}


def check_no_foreign_log(run_dir: str | Path) -> None:
    """Refuse a fresh start (no checkpoint) in a run directory whose `metrics.jsonl` has rows: another run's log,
    which appending would corrupt. Cheap: call it before any slow work."""
    run_dir = Path(run_dir)
    if not saved_steps(run_dir / "checkpoints") and (rows := read_metrics(run_dir)):
        raise OutputExistsError(
            f"{run_dir / 'metrics.jsonl'} holds {len(rows)} metric rows but {run_dir / 'checkpoints'} has no "
            "checkpoint to resume from: it is another run's log; use a new run directory, or move metrics.jsonl "
            "away to start this one over")


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metric rows past the restored step: they are recomputed (a crash between checkpoints)."""
    rows = read_metrics(run_dir)
    if jax.process_index() == 0 and any(r["step"] > step for r in rows):
        write_atomic(run_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def mean_metrics(batches: list[dict[str, jax.Array]]) -> dict[str, float]:
    return {k: float(np.mean([float(b[k]) for b in batches])) for k in batches[0]}
