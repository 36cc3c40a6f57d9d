"""Where amphista-jax keeps what it makes for a user: fetched models and datasets, compiled programs, calibrations
and kernels, under `AMPHISTA_HOME` (default `~/.cache/amphista-jax`)."""

from __future__ import annotations

import os
from pathlib import Path


def amphista_home() -> Path:
    return Path(os.environ.get("AMPHISTA_HOME") or "~/.cache/amphista-jax").expanduser()
