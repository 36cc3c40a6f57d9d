"""Compiled programs kept across runs: JAX's persistent compilation cache, under `<home>/compiled/<key>`.

`key` digests what makes a compiled program unusable elsewhere: the machine (`machine.Machine.key`: backend, device,
CPU features, cores, memory, amphista-jax's and jax's versions), jaxlib's version and the XLA flags of the
environment (`XLA_FLAGS`, `LIBTPU_INIT_ARGS`); another of any of them reads and writes another folder, so no entry is
ever reused across them. On by default; `AMPHISTA_COMPILE_CACHE=0` turns it off, and a cache folder the process set
already (`jax_compilation_cache_dir`) is kept. A home where the folder cannot be
made or written leaves it off with one `note:` line on stderr; an entry JAX cannot read (damaged) is one `note:` line
for the process, naming the folder to delete, and a recompile (JAX leaves the entry as it is).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import warnings
from pathlib import Path

import jax

from amphista_jax.infra.machine import Machine, this_machine

SETTING = "AMPHISTA_COMPILE_CACHE"  # "0": off
FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
MIN_COMPILE_SECONDS = 0.5  # programs that compile faster are not worth a file
_UNREADABLE = ("Error reading persistent compilation cache entry", "Error writing persistent compilation cache entry")


def cache_key(machine: Machine, jaxlib: str, env: dict[str, str]) -> str:
    """A short digest of the machine, jaxlib's version and the XLA flags in `env`."""
    parts = {"machine": machine.key(), "jaxlib": jaxlib, "flags": {k: env.get(k, "") for k in FLAGS}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def enable_compile_cache(home: Path) -> Path | None:
    """Point JAX's persistent compilation cache at this machine's folder under `home` (unless the process points it
    somewhere already: that folder); the folder, or None where the setting is off or the folder cannot be written
    (said in one `note:` line)."""
    if os.environ.get(SETTING, "1").strip() == "0":
        return None
    if jax.config.jax_compilation_cache_dir:  # the process's own choice
        return Path(jax.config.jax_compilation_cache_dir)
    path = Path(home) / "compiled" / cache_key(this_machine(), importlib.metadata.version("jaxlib"), dict(os.environ))
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        print(f"note: compiled programs are not kept across runs: {path} cannot be written ({e.strerror}); set "
              f"AMPHISTA_HOME to a writable folder, or {SETTING}=0 to silence this", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    _note_unreadable_entries(path)
    return path


def cache_entries() -> set[str] | None:
    """The files of the persistent compilation cache this process writes to (whoever set it); None: none."""
    folder = jax.config.jax_compilation_cache_dir
    return {p.name for p in Path(folder).glob("*")} if folder and Path(folder).is_dir() else None


def _note_unreadable_entries(path: Path) -> None:
    """JAX's warning per cache entry it cannot read or write becomes one `note:` line for the process."""
    show = warnings.showwarning
    if getattr(show, "amphista_cache_note", False):
        return
    noted = []

    def showwarning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    file: object = None, line: str | None = None) -> None:
        if not str(message).startswith(_UNREADABLE):
            return show(message, category, filename, lineno, file, line)
        if not noted:
            noted.append(True)
            print(f"note: a compiled program cached in {path} could not be read or written, so it was compiled again; "
                  "delete that folder to rebuild the cache", file=sys.stderr)
        return None

    showwarning.amphista_cache_note = True
    warnings.showwarning = showwarning
