"""Per-prompt result files: `results/<label>.process<i>.jsonl`, one JSON line per finished prompt.

Each process appends only to its own file (flush + fsync per line), so a process that dies loses only the
prompt it was on. On restart every process reads every file of a method (the process count may differ
between runs) and skips the prompts already there; a torn last line (a crash mid-write) is ignored, and cut
off before the file is appended to again. Merging keeps the first record of each prompt id.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def safe_label(label: str) -> str:
    """A file-name-safe form of a method label."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", label).strip("_") or "method"


def process_file(results_dir: Path, label: str, process: int) -> Path:
    return results_dir / f"{safe_label(label)}.process{process}.jsonl"


def _lines(path: Path) -> list[Record]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn write: that prompt is not finished
    return out


def read_results(results_dir: Path, label: str) -> list[Record]:
    """Every finished record of `label` from every process's file, first record per id, in file order."""
    merged: dict[str, Record] = {}
    pattern = re.compile(rf"^{re.escape(safe_label(label))}\.process\d+\.jsonl$")
    for path in sorted(results_dir.glob("*.jsonl")):
        if pattern.match(path.name):
            for r in _lines(path):
                merged.setdefault(r["id"], r)
    return list(merged.values())


class ResultWriter:
    """Appends records durably to one process's file, after cutting a torn last line."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            data = path.read_bytes()
            if data and not data.endswith(b"\n"):
                path.write_bytes(data[: data.rfind(b"\n") + 1])
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: Record) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()
