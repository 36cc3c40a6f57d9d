"""An exclusive lock on an output directory, so that two runs never write one output together.

`output_lock(directory, command)` creates `<directory>/.amphista-lock` with `O_CREAT | O_EXCL` (atomic on local
and NFS v3+ file systems), holding the owner's pid, host, command and start time, and removes it when the block
ends, however it ends. A second run finds the file and stops with one line naming the owner. A lock whose owner
is gone (same host, no such pid: a killed run) is stale: it is named in a note and taken over. A lock from another
host cannot be checked from here: the line says which host holds it and how to clear it by hand.

`atomic_file(path)` / `write_atomic(path, text)` write one file under a temporary name in its directory and rename
it into place when complete, so a reader (a later run, a resume) finds the old file or the new one, never a torn
one: every report, summary, policy and run record goes through them.

`staged_output(out, command)` makes a new output directory whole or not at all: it is written as a staging
directory beside it (`.<name>.partial-<pid>`, locked the same way) and renamed into place only when the block ends
without error; an error removes it, and a killed run's staging directory is named and removed by the next run. With
`replace`, an earlier output stays whole until the new one is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from amphista_jax.infra.errors import UserError

LOCK_FILE = ".amphista-lock"


class OutputLockedError(UserError, RuntimeError):
    """Another run is writing this output directory."""


def _owner(path: Path) -> dict:
    try:
        owner = json.loads(path.read_text())
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}  # being written this instant, or damaged: treated as held by an unknown owner


def _running(owner: dict) -> bool | None:
    """Whether the owner still runs: None when that cannot be told from this host."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return None
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def output_lock(directory: str | Path, command: str) -> contextlib.AbstractContextManager[Path]:
    """Hold `directory`'s lock (`<directory>/.amphista-lock`; the directory is made if missing) for the block."""
    return file_lock(Path(directory) / LOCK_FILE, command)


def lock_beside(output: str | Path) -> Path:
    """The lock file of one output file (`<file>.lock`), for commands that write a file, not a directory."""
    return Path(output).with_name(Path(output).name + ".lock")


@contextlib.contextmanager
def file_lock(path: Path, command: str) -> Iterator[Path]:
    """Hold the lock file `path` (its directory is made if missing) for the block; yields its path."""
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "started": time.time()}
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            owner = _owner(path)
            who = f"{owner.get('command', 'a run')} (pid {owner.get('pid', '?')} on {owner.get('host', '?')})"
            running = _running(owner)
            if running is False:
                print(f"note: {directory}: the lock of {who} is stale (that process is gone): taking it over",
                      file=sys.stderr)
                path.unlink(missing_ok=True)
                continue
            how = ("wait for it to finish, or use another output directory" if running else
                   f"if that run is over, delete {path}; else wait for it or use another output directory")
            raise OutputLockedError(f"{directory} is being written by {who}: {how}") from None
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)
    try:
        yield path
    finally:
        if _owner(path).get("pid") == me["pid"]:
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` (same suffix, so writers that read it pick the same format); rename it
    to `path` when the block ends without error, remove it when it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to `path` whole (`atomic_file`)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def _pid_of(path: Path) -> int | None:
    """The writer's pid in a staging or set-aside name (`.<name>.<kind>-<pid>`)."""
    tail = path.name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


@contextlib.contextmanager
def staged_output(out: str | Path, command: str, replace: bool = False) -> Iterator[Path]:
    """Yield a staging directory for the output directory `out`; rename it to `out` when the block ends without
    error, remove it when it raises. `out` is absent or empty (the caller checks), or with `replace` an earlier
    output of the same kind: it stays whole until the new one is complete, what in it the new one does not write
    (a user's notes) is carried over, then it is swapped out and removed. A staging directory left by a killed run
    is named and removed (one whose writer still runs is refused: `OutputLockedError`); an old output a killed
    swap had moved aside is put back when `out` is missing."""
    out = Path(out).absolute()
    for stale in sorted(out.parent.glob(f".{out.name}.partial-*")):
        owner = _owner(stale / LOCK_FILE)
        running = _running(owner)
        if running:
            raise OutputLockedError(f"{out} is being written by {owner.get('command', 'a run')} (pid "
                                    f"{owner.get('pid')}, staging in {stale}): wait for it or pick another output")
        if running is False or not owner:
            print(f"note: {stale}: a partial output of a killed run; removing it", file=sys.stderr)
            shutil.rmtree(stale, ignore_errors=True)
    for aside in sorted(out.parent.glob(f".{out.name}.replaced-*")):
        if _running({"pid": _pid_of(aside), "host": socket.gethostname()}):
            continue  # that run is swapping it this instant
        if out.exists():
            shutil.rmtree(aside, ignore_errors=True)  # the swap completed; its removal was cut short
        else:
            print(f"note: {out}: restoring the earlier output a killed run had moved aside", file=sys.stderr)
            os.replace(aside, out)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        with file_lock(staging / LOCK_FILE, command):
            yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _swap_in(staging, out, replace)


def _swap_in(staging: Path, out: Path, replace: bool) -> None:
    """Rename the complete `staging` to `out` (see `staged_output`); on failure `out` is as it was."""
    aside = out.parent / f".{out.name}.replaced-{os.getpid()}"
    carried: list[str] = []  # what the new output does not write, moved over from the old one
    try:
        if out.is_dir() and replace:
            for entry in out.iterdir():
                if not (staging / entry.name).exists():
                    os.replace(entry, staging / entry.name)
                    carried.append(entry.name)
            os.replace(out, aside)
        elif out.is_dir():
            out.rmdir()  # empty: a non-empty one was refused before any work
        os.replace(staging, out)
    except BaseException:
        if aside.is_dir() and not out.exists():
            os.replace(aside, out)
        for name in carried:
            if (staging / name).exists():
                os.replace(staging / name, out / name)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
