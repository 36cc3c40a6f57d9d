"""Package data: the embedded default target model, draft heads trained for it and its sibling draft model."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "code-llama"
HEADS_DIR = Path(__file__).parent / f"{DEFAULT_MODEL}-heads"


def default_model_dir() -> Path:
    """Directory of the embedded default target (a Hugging Face checkpoint shipped with the package)."""
    path = Path(__file__).parent / DEFAULT_MODEL
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the embedded model is missing from {path}; reinstall amphista-jax or pass --model")
    return path


def draft_model_dir() -> Path:
    """The embedded target's shipped sibling, a draft model for it (`configs/target/code-draft.yaml`)."""
    path = Path(__file__).parent / f"{DEFAULT_MODEL}-draft"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the shipped draft model is missing from {path}; train one with `amphista-jax "
                                "pretrain-target --config configs/target/code-draft.yaml`")
    return path


def shipped_heads() -> list[str]:
    """Names of the head sets shipped for the embedded model (`medusa`, `amphista`, `hydra`, `hydra-plus`)."""
    return sorted(p.name for p in HEADS_DIR.iterdir() if (p / "draft.json").is_file()) if HEADS_DIR.is_dir() else []


def shipped_heads_dir(name: str) -> Path:
    """Draft heads `name` trained for the embedded model (`amphista_jax/assets/code-llama-heads/<name>`)."""
    path = HEADS_DIR / name
    if not (path / "draft.json").is_file():
        shipped = ", ".join(shipped_heads()) or "none"
        raise FileNotFoundError(f"no shipped {name} heads in {HEADS_DIR} (shipped: {shipped}); "
                                "train them with `amphista-jax train` and pass --heads")
    return path
