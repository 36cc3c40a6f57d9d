"""Draft heads people have already trained, read from the layouts their reference repositories release, into our
drafters' params (`amphista-jax convert --heads-from FORMAT DIR --model TARGET --out HEADS`).

`medusa` (FasterDecoding/Medusa): `config.json` (`medusa_num_heads`, `medusa_num_layers`) beside
`medusa_lm_head.safetensors` or `medusa_lm_head.pt` (read without torch: `models/torch_files.py`). Head `i` is
`nn.Sequential(ResBlock x n, Linear(D, V, bias=False))`: keys `{i}.{j}.linear.weight [D, D]` and
`{i}.{j}.linear.bias [D]` for its ResBlocks `j < n` (`x + SiLU(W x + b)`, torch's `[out, in]` layout) and
`{i}.{n}.weight [V, D]`, the head's own vocabulary projection: exactly our `Medusa` (its paper's form,
`shared_lm_head=False`), with `w = W^T`. A `medusa_head.` prefix (a whole model's state dict) is accepted.

Every checkpoint is checked against the target (hidden size, vocabulary) before anything is written, one line
each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from amphista_jax.drafters.io import params_fit
from amphista_jax.drafters.medusa import Medusa
from amphista_jax.errors import UserError
from amphista_jax.models.torch_files import read_tensors
from amphista_jax.target import Target

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")


class PublishedHeadsError(UserError, ValueError):
    """Released heads that cannot be read, or that belong to another target."""


def _first_file(src: Path, names: tuple[str, ...], fmt: str) -> Path:
    for name in names:
        if (src / name).is_file():
            return src / name
    raise PublishedHeadsError(f"{src} holds none of {', '.join(names)}: point --heads-from {fmt} at the directory "
                              "of the released heads")


def _check(what: str, got: tuple[int, ...], want: tuple[int, ...], target: Target) -> None:
    if got != want:
        raise PublishedHeadsError(f"{what} has shape {got}, but the target (hidden size {target.config.hidden_size}, "
                                  f"vocabulary {target.config.vocab_size}) needs {want}: these heads were trained "
                                  "for another model; pass that model as --model")


def read_medusa(src: str | Path, target: Target) -> tuple[Medusa, dict]:
    """(the drafter, its params) of FasterDecoding's released Medusa heads in `src`, checked against `target`."""
    src = Path(src)
    tensors = read_tensors(_first_file(src, MEDUSA_FILES, "medusa"))
    tensors = {k.removeprefix("medusa_head."): v for k, v in tensors.items()}
    config = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    found = [tuple(int(x) for x in m.groups()) for k in tensors if (m := re.fullmatch(r"(\d+)\.(\d+)\.weight", k))]
    if not found:
        raise PublishedHeadsError(f"{src} has no `<head>.<layer>.weight` projection: not Medusa's released layout")
    k = int(config.get("medusa_num_heads", max(i for i, _ in found) + 1))
    n = int(config.get("medusa_num_layers", max(j for _, j in found)))
    d, v = target.config.hidden_size, target.config.vocab_size

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise PublishedHeadsError(f"{src} has no tensor {name} ({k} heads of {n} ResBlocks, from config.json or "
                                      "the file's keys): the file is incomplete or not Medusa's")
        _check(name, tuple(tensors[name].shape), shape, target)
        return np.asarray(tensors[name], np.float32)

    w = [[get(f"{i}.{j}.linear.weight", (d, d)).T for j in range(n)] for i in range(k)]
    b = [[get(f"{i}.{j}.linear.bias", (d,)) for j in range(n)] for i in range(k)]
    lm_head = [get(f"{i}.{n}.weight", (v, d)).T for i in range(k)]
    drafter = Medusa(num_heads=k, num_layers=n)
    params = {"w": jnp.asarray(np.stack(w)), "b": jnp.asarray(np.stack(b)), "lm_head": jnp.asarray(np.stack(lm_head))}
    if not params_fit(drafter, params, target):
        raise PublishedHeadsError(f"the converted {drafter.name} params do not match the drafter's own layout")
    return drafter, params


READERS = {"medusa": read_medusa}
