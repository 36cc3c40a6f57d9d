"""The project's error types for bad input: the CLI prints their message as one line and exits with
`BAD_INPUT_EXIT` (no traceback unless `--debug` or `AMPHISTA_DEBUG=1`).

A message says what is wrong and how to fix it. Every module's own error class derives from `UserError`
(and from the builtin it refines, so `except ValueError` callers keep working).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

BAD_INPUT_EXIT = 2  # as argparse's usage errors
ENVIRONMENT_EXIT = 3  # the machine refused: no space, read-only or forbidden path


class UserError(Exception):
    """Bad input: an argument, config, file or checkpoint the user can fix."""


class UsageError(UserError, ValueError):
    """A command-line argument that cannot work."""


class GeneratorError(UserError, ValueError):
    """A `Generator` call that cannot work as asked."""


class DecodeSpecError(GeneratorError):
    """A decode setting out of range (`decode_spec.DecodeSpec`): `field` is the setting's name, `value` what was
    given, `rule` what it must be; a front-end names its own flag for `field` (`--top-k` for `top_k`)."""

    def __init__(self, field: str, value: object, rule: str):
        self.field, self.value, self.rule = field, value, rule
        super().__init__(f"{field}={value!r}: {rule}")


class MachineRefusal(UserError, OSError):
    """The machine refuses what the command needs (a read-only or forbidden path, too little free space): the CLI
    exits with `ENVIRONMENT_EXIT`, as it does for the OSErrors of `ENVIRONMENT_ERRNOS`."""


class OutputExistsError(UserError, FileExistsError):
    """An output path that holds something the user made: refused, never overwritten."""


# OSErrors that describe the machine rather than a bug: reported as one line.
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG})


def check_writable_dir(path: str | Path, what: str, need_bytes: int = 0) -> None:
    """Raise `MachineRefusal` unless `path` (a directory, created later if missing) can be written, with
    `need_bytes` free where that can be estimated (`UsageError` where it is a file). Call before any slow work."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{what} {path}: {existing} is a file, not a directory; pick another path")
    probe = existing / f".amphista-write-probe-{os.getpid()}-{id(path)}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise MachineRefusal(f"{what} {path} cannot be written ({e.strerror}): pick a writable directory") from None
    free = shutil.disk_usage(existing).free
    if need_bytes and free < need_bytes:
        raise MachineRefusal(f"{what} {path}: {free / 2**20:.0f} MiB free but about {need_bytes / 2**20:.0f} MiB are "
                         "needed; free space or pick another disk")
