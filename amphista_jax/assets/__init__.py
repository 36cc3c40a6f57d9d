"""Package data: the embedded default target model and draft heads trained for it."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "tiny-code-llama"


def default_model_dir() -> Path:
    """Directory of the embedded default target (a Hugging Face checkpoint shipped with the package)."""
    path = Path(__file__).parent / DEFAULT_MODEL
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the embedded model is missing from {path}; reinstall amphista-jax or pass --model")
    return path


def shipped_heads_dir(method: str) -> Path:
    """Draft heads of `method` trained for the embedded model (`amphista_jax/assets/tiny-code-llama-heads`)."""
    root = Path(__file__).parent / f"{DEFAULT_MODEL}-heads"
    path = root / method
    if not (path / "draft.json").is_file():
        shipped = sorted(p.name for p in root.iterdir() if (p / "draft.json").is_file()) if root.is_dir() else []
        raise FileNotFoundError(f"no shipped {method} heads in {root} (shipped: {', '.join(shipped) or 'none'}); "
                                "train them with `amphista-jax train` and pass --heads")
    return path
