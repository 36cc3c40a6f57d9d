"""What a training run was started with, kept in `out_dir/run.json` and checked at every start, so that a
rerun resumes only the same run: never mixes two runs' checkpoints, and never rewrites a finished one.

An identity is a JSON dict: the full config, and sha256 digests of what it reads (the target's files, the data
files). `differences` names what changed between two identities, leaving out the fields in `BOOKKEEPING`: how
a run is logged, checkpointed or laid out on devices, not what it learns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from amphista_jax.infra.identity import RunMismatchError, changes
from amphista_jax.infra.output_lock import write_atomic

RUN_FILE = "run.json"
BOOKKEEPING = frozenset({"out_dir", "mesh", "loop.checkpoint_every", "loop.keep_checkpoints", "loop.log_every",
                         "data.store_layers"})


def _bookkeeping(key: str) -> bool:
    return any(key == b or key.startswith(b + ".") for b in BOOKKEEPING)


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What differs between two identities, one short phrase each: `optim.lr 0.001 -> 0.002`, `target
    model.safetensors changed`, `data.train changed (30 -> 31 files)`."""
    diffs = []
    current = json.loads(json.dumps(current))  # as `recorded` was read back: tuples as lists
    for key, (old, new) in sorted(changes(recorded.get("config", {}), current.get("config", {})).items()):
        if not _bookkeeping(key):
            diffs.append(f"{key} {json.dumps(old)} -> {json.dumps(new)}")
    for group in ("target", "data"):
        old_files, new_files = recorded.get(group, {}), current.get(group, {})
        for name in sorted(set(old_files) | set(new_files)):
            a, b = old_files.get(name), new_files.get(name)
            if a == b:
                continue
            counts = (f" ({a['files']} -> {b['files']} files)" if isinstance(a, dict) and isinstance(b, dict)
                      and a.get("files") != b.get("files") else "")
            what = "added" if a is None else "removed" if b is None else "changed"
            diffs.append(f"{group if group == 'target' else ''} {name} {what}{counts}".strip())
    return diffs


def read_identity(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / RUN_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunMismatchError(f"{path} is damaged ({e}): the run's settings cannot be checked; use a new "
                               "out_dir") from None


def check_same_run(out_dir: Path, current: Mapping[str, Any]) -> None:
    """Raise `RunMismatchError` unless `out_dir/run.json` (if any) records the identity `current`."""
    recorded = read_identity(out_dir)
    if recorded is None or not (diffs := differences(recorded, current)):
        return
    shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
    raise RunMismatchError(
        f"out_dir {out_dir} holds a run started with other settings ({shown}): continuing it would mix two runs. "
        f"Use a new out_dir, or restore the settings recorded in {out_dir / RUN_FILE}")


def write_identity(out_dir: Path, identity: Mapping[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / RUN_FILE, json.dumps(identity, indent=2, sort_keys=True) + "\n")
