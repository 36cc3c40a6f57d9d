"""Content identity of a run's inputs, recorded in its `run.json` so that a resume (training or evaluation)
refuses inputs that changed under the same path: sha256 of files read in chunks (a 7B target never sits in
memory for it), digests of file sets, and the differences between two recorded identities."""

from __future__ import annotations

import glob
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from amphista_jax.infra.errors import UserError

_CHUNK = 1 << 24
# Files of a HF checkpoint that change what it computes or generates (weights, architecture, tokenization,
# chat template, stop tokens).
TARGET_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "generation_config.json", "tokenizer.model",
                "chat_template.jinja")


class RunMismatchError(UserError, ValueError):
    """A run directory that holds another run (other settings, target, heads or data) than the one asked for."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def json_digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def tree_digests(root: Path, patterns: tuple[str, ...]) -> dict[str, str]:
    """{path relative to `root`: sha256} of the files matching `patterns` (globs; `**` recurses)."""
    files = sorted({f for p in patterns for f in Path(root).glob(p) if f.is_file()})
    return {f.relative_to(root).as_posix(): sha256_file(f) for f in files}


def target_identity(model_dir: str | Path) -> dict[str, str]:
    return tree_digests(Path(model_dir), TARGET_FILES)


def heads_identity(heads_dir: str | Path) -> dict[str, str]:
    """draft.json and the params; not `trees/` (tree-search adds trees beside the heads, and a run records the
    tree it uses on its own)."""
    return tree_digests(Path(heads_dir), ("draft.json", "params/**/*"))


def matching_files(pattern: str) -> list[Path]:
    """A file, every file under a directory (recursively), or the files a glob matches; sorted."""
    base = Path(pattern)
    if base.is_file():
        return [base]
    names = base.rglob("*") if base.is_dir() else map(Path, glob.glob(pattern, recursive=True))
    return sorted(p for p in names if p.is_file())


def files_digest(files: Iterable[Path], root: Path | None = None) -> dict[str, Any]:
    """One digest over the names (relative to `root`) and contents of `files`, with their count and size."""
    h, n, size = hashlib.sha256(), 0, 0
    for f in files:
        name = f.relative_to(root).as_posix() if root else f.name
        h.update(f"{name}\0{sha256_file(f)}\n".encode())
        n, size = n + 1, size + f.stat().st_size
    return {"sha256": h.hexdigest(), "files": n, "bytes": size}


def changes(before: object, now: object, key: str = "") -> dict[str, tuple[object, object]]:
    """{dotted key: (before, now)} of the leaves that differ between two JSON-like values."""
    if isinstance(before, dict) and isinstance(now, dict):
        out: dict[str, tuple[object, object]] = {}
        for k in [*before, *(k for k in now if k not in before)]:
            out |= changes(before.get(k), now.get(k), f"{key}.{k}" if key else str(k))
        return out
    return {} if before == now else {key: (before, now)}
