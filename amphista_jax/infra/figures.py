"""The PNGs every report writes: matplotlib without a display, and each figure written whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from amphista_jax.infra.output_lock import atomic_file


def pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    """Lay out `fig`, write it to `path` as a PNG (renamed into place when complete: `atomic_file`) and close it."""
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, dpi=120)
    pyplot().close(fig)
    return Path(path)
