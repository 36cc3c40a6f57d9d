"""Optimizers: AdamW with linear warmup + cosine decay and global-norm clipping."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import optax

from amphista_jax.infra.ranges import check_ranges, setting


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = setting(1e-3, gt=0)
    warmup_steps: int = setting(100, ge=0)
    min_lr_ratio: float = setting(0.1, ge=0, le=1)
    b1: float = setting(0.9, ge=0, lt=1)
    b2: float = setting(0.999, ge=0, lt=1)
    weight_decay: float = setting(0.0, ge=0)
    clip_norm: float = setting(1.0, gt=0, why="the global gradient norm is clipped to it")

    def __post_init__(self) -> None:
        check_ranges(self)


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
