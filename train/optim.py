"""Optimizers: AdamW with linear warmup + cosine decay and global-norm clipping."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import optax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.0
    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        checks = ((self.lr > 0, "lr", "> 0"), (self.warmup_steps >= 0, "warmup_steps", ">= 0"),
                  (0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]"), (0 <= self.b1 < 1, "b1", "in [0, 1)"),
                  (0 <= self.b2 < 1, "b2", "in [0, 1)"), (self.weight_decay >= 0, "weight_decay", ">= 0"),
                  (self.clip_norm > 0, "clip_norm", "> 0 (the global gradient norm is clipped to it)"))
        for ok, name, rule in checks:
            if not ok:  # NaN fails every rule
                raise ValueError(f"{name}={getattr(self, name)} must be {rule}")


def make_optimizer(cfg: OptimConfig, total_steps: int,
                   part_lrs: Mapping[str, float] | None = None) -> optax.GradientTransformation:
    """Clipped AdamW on a warmup-cosine schedule. `part_lrs` gives top-level parameter groups (keys of the
    params dict) their own peak learning rate; the rest use `cfg.lr`."""
    def adamw(lr: float) -> optax.GradientTransformation:
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=lr, warmup_steps=cfg.warmup_steps,
            decay_steps=max(total_steps, cfg.warmup_steps + 1), end_value=lr * cfg.min_lr_ratio)
        return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)

    inner = adamw(cfg.lr)
    if part_lrs:
        groups = {name: adamw(lr) for name, lr in part_lrs.items()} | {"default": inner}
        inner = optax.multi_transform(groups, lambda params: {
            k: jax.tree.map(lambda _, k=k: k if k in part_lrs else "default", v) for k, v in params.items()})
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), inner)
