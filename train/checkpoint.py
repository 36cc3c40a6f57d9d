"""Orbax checkpoints of (train state, data-iterator state, bookkeeping): async, atomic, resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


class CheckpointRestoreError(RuntimeError):
    """A checkpoint step that exists but cannot be restored."""


class Checkpointer:
    """Keeps the last `keep` steps under `directory`; `save` is a no-op between `every` steps unless forced."""

    def __init__(self, directory: str | Path, keep: int = 2, every: int = 100):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=every,
                                                 enable_async_checkpointing=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, extra: dict[str, Any], force: bool = False) -> bool:
        """Save `state` (a pytree of arrays) and `extra` (JSON: data-iterator state, counters).

        A step that is already saved is left as it is (orbax also saves a run's first step).
        """
        if step == self.latest_step():
            return False
        return self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)),
            force=force)

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

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
