"""Orbax checkpoints of (train state, data-iterator state, bookkeeping): async, atomic, resumable."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from amphista_jax.infra.errors import MachineRefusal, UserError


class CheckpointRestoreError(UserError, RuntimeError):
    """A checkpoint step that exists but cannot be restored."""


class CheckpointSaveError(MachineRefusal):
    """A checkpoint that could not be written (disk full, read-only or vanished directory): training stops at
    once rather than running on without a way to resume, and the CLI exits as for any machine refusal."""


def saved_steps(directory: str | Path) -> list[int]:
    """The finished checkpoint steps under `directory` (orbax names each by its step; unfinished saves carry a
    temporary suffix), ascending; [] when there is none or no directory."""
    directory = Path(directory)
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def _os_error_code(e: BaseException) -> int | None:
    """The OS error behind an I/O failure (tensorstore reports `[os_error_code='28']` inside a long message)."""
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    m = re.search(r"os_error_code='?(\d+)", str(e))
    return int(m.group(1)) if m else None


class _DropOrbaxTracebacks(logging.Filter):
    """Orbax logs a background save's failure with its traceback before the failure is re-raised to us; we
    report it once, as `CheckpointSaveError`, so the log copy is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and "orbax" in record.pathname)


@contextlib.contextmanager
def _save_errors(directory: Path) -> Iterator[None]:
    """Turn a failure of orbax's saving that the machine caused (an OS error: no space, read-only, a vanished
    directory) into one `CheckpointSaveError` naming the reason and the fix; anything else is a bug and raises
    as it is."""
    try:
        yield
    except Exception as e:  # orbax and tensorstore raise ValueError/OSError/RuntimeError for I/O failures
        if (code := _os_error_code(e)) is None:
            raise
        steps = saved_steps(directory)
        rerun = f"to resume from step {steps[-1]}" if steps else "to start over (no checkpoint was complete)"
        raise CheckpointSaveError(
            f"saving a checkpoint in {directory} failed, training stopped: {os.strerror(code)}. Free space or make "
            f"the directory writable, then rerun the same command {rerun}") from e


class Checkpointer:
    """Keeps the last `keep` steps under `directory`; `save` is a no-op between `every` steps unless forced."""

    def __init__(self, directory: str | Path, keep: int = 2, every: int = 100):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every,
                                                 enable_async_checkpointing=True),
        )
        self._filter = _DropOrbaxTracebacks()
        logging.getLogger("absl").addFilter(self._filter)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, extra: dict[str, Any], force: bool = False) -> bool:
        """Save `state` (a pytree of arrays) and `extra` (JSON: data-iterator state, counters).

        A step that is already saved is left as it is (orbax also saves a run's first step). Raises
        `CheckpointSaveError` as soon as an earlier background save is seen to have failed (checked at every
        call, without waiting for a save in progress).
        """
        self.check()
        if step == self.latest_step():
            return False
        with _save_errors(self.directory):
            saved = self.manager.save(
                step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)),
                force=force)
            self.manager.check_for_errors()
        return saved

    def check(self) -> None:
        """Raise `CheckpointSaveError` if a finished background save failed; never blocks on one in progress."""
        if self.manager.is_saving_in_progress():
            return
        with _save_errors(self.directory):
            self.manager.wait_until_finished()  # returns at once here, re-raising a finished save's error
            self.manager.check_for_errors()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore (state, extra) from `step` (default: the latest) into the structure of `abstract_state`."""
        step = self.latest_step() if step is None else step
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), extra=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises many types for damaged or mismatched checkpoints
            raise CheckpointRestoreError(
                f"checkpoint step {step} in {self.directory} cannot be restored ({type(e).__name__}: {e}). "
                f"If it is damaged, delete {self.directory / str(step)} to resume from the step before; if it "
                "belongs to another model or config, point the run at a fresh directory") from e
        return out.state, dict(out.extra)

    def close(self, check: bool = True) -> None:
        """Wait for the last save and release orbax's threads; `check=False` (closing after another error)
        does not raise the save's own failure."""
        failed = True
        try:
            with _save_errors(self.directory) if check else contextlib.suppress(Exception):
                self.manager.wait_until_finished()
                self.manager.check_for_errors()
            failed = False
        finally:
            with contextlib.suppress(Exception) if failed or not check else contextlib.nullcontext():
                self.manager.close()
            logging.getLogger("absl").removeFilter(self._filter)
