"""Package data: the embedded default target model."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "tiny-code-llama"


def default_model_dir() -> Path:
    """Directory of the embedded default target (a Hugging Face checkpoint shipped with the package)."""
    path = Path(__file__).parent / DEFAULT_MODEL
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the embedded model is missing from {path}; reinstall amphista-jax or pass --model")
    return path
