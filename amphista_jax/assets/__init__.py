"""Package data: the embedded default target model, draft heads trained for it and its sibling draft model, and
draft heads trained for the fetched real target (`smollm2-heads/`, `amphista-jax fetch smollm2`)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL = "code-llama"
HEADS_DIR = Path(__file__).parent / f"{DEFAULT_MODEL}-heads"
REAL_TARGET = "smollm2"  # the fetched real target (`amphista_jax.models.fetch`) heads are shipped for


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


def shipped_heads_root(target: str) -> Path:
    """Where what is shipped for `target` lives: a directory per head set (and per method with nothing to train,
    holding only its acceptance statistics)."""
    return Path(__file__).parent / f"{target}-heads"


def shipped_heads(target: str = DEFAULT_MODEL) -> list[str]:
    """Names of the head sets shipped for `target` (the embedded model: `medusa`, `amphista`, `hydra`, ...;
    `smollm2`: the fetched real target's)."""
    root = shipped_heads_root(target)
    return sorted(p.name for p in root.iterdir() if (p / "draft.json").is_file()) if root.is_dir() else []


def shipped_heads_dir(name: str, target: str = DEFAULT_MODEL) -> Path:
    """Draft heads `name` trained for `target` (`amphista_jax/assets/<target>-heads/<name>`)."""
    path = shipped_heads_root(target) / name
    if not (path / "draft.json").is_file():
        shipped = ", ".join(shipped_heads(target)) or "none"
        raise FileNotFoundError(f"no shipped {name} heads in {path.parent} (shipped: {shipped}); "
                                "train them with `amphista-jax train` and pass --heads")
    return path
