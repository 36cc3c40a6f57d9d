"""Draft-head checkpoints: `draft.json` (method, its settings, the target it was trained for) + orbax params.

Loading checks that the heads fit the target they are used with, so heads trained for another model are a
clear error rather than garbage drafts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from amphista_jax.drafters import DRAFTERS, Drafter
from amphista_jax.infra.errors import UserError
from amphista_jax.infra.output_lock import write_atomic
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.param_layout import layer_params, projection_kernel
from amphista_jax.models.target import Target

META_FILE = "draft.json"
TARGET_KEYS = ("model_type", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads")


class DraftCheckpointError(UserError, ValueError):
    """Draft heads that cannot be loaded for this target."""


def target_fingerprint(config: ModelConfig) -> dict[str, Any]:
    return {k: getattr(config, k) for k in TARGET_KEYS}


def target_sample(params: dict) -> list[float]:
    """16 of the target's weights at fixed places (embedding rows spread over the vocabulary, the last layer's
    query projection): tells apart two targets of one shape, and survives a dtype conversion or re-sharding
    (compared with a relative tolerance)."""

    def pick(p: dict) -> jax.Array:
        embed = p["embed"]["embedding"]  # [V, D]
        q = projection_kernel(layer_params(p, -1)["attn"]["q_proj"])  # [D, H*Dh]
        rows = jax.numpy.arange(8) * (embed.shape[0] // 8)
        cols = jax.numpy.arange(8) % embed.shape[1]
        return jax.numpy.concatenate([embed[rows, cols], q[cols, cols % q.shape[1]]]).astype(jax.numpy.float32)

    return [float(x) for x in np.asarray(jax.jit(pick)(params))]


def cast_floating(params: Any, dtype: str | jax.numpy.dtype) -> Any:
    """`params` with every floating leaf cast to `dtype` (integer leaves, e.g. draft-vocabulary ids, kept)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, params)


# Params are written in chunks of at most CHUNK_BYTES, into data files closed once past FILE_BYTES: every file of a
# heads directory stays under 15 MiB (FILE_BYTES + one chunk), so heads travel where large files do not.
CHUNK_BYTES = 4 * 2**20
FILE_BYTES = 8 * 2**20


def save_draft(path: str | Path, method: str, drafter: Drafter, params: Any, target_config: ModelConfig,
               dtype: str | None = None, target_params: dict | None = None) -> Path:
    """Write `draft.json` and the params (floating leaves cast to `dtype` when given, e.g. "bfloat16" for
    shipping; `load_draft` restores them in the drafter's own fp32), in files under 15 MiB (`CHUNK_BYTES`). With
    `target_params`, `draft.json` also records `target_sample` so that loading refuses another target of the same
    shape."""
    path = Path(path).absolute()
    if dtype is not None:
        params = cast_floating(params, dtype)
    path.mkdir(parents=True, exist_ok=True)
    meta = {"method": method, "settings": dataclasses.asdict(drafter), "target": target_fingerprint(target_config)}
    if target_params is not None:
        meta["target_sample"] = target_sample(target_params)
    chunked = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), params)
    with ocp.PyTreeCheckpointer() as ckpt:  # every process takes part; orbax writes once
        ckpt.save(path / "params", args=ocp.args.PyTreeSave(params, save_args=chunked,
                                                            ocdbt_target_data_file_size=FILE_BYTES), force=True)
    if jax.process_index() == 0:
        write_atomic(path / META_FILE, json.dumps(meta, indent=2) + "\n")
    return path


@dataclasses.dataclass(frozen=True)
class DraftMeta:
    """What a heads directory's `draft.json` says: the method, its drafter (settings only; no params are read)
    and the target the heads were trained for."""

    method: str
    drafter: Drafter
    target: dict[str, Any]
    target_sample: list[float] | None


def read_draft_meta(path: str | Path) -> DraftMeta:
    """`path`'s `draft.json`, checked field by field: a `DraftCheckpointError` (one line naming the fix) for a
    directory without one, a damaged file, an unknown method or settings the method does not take."""
    meta_file = Path(path) / META_FILE
    if not meta_file.is_file():
        raise DraftCheckpointError(f"{path} is not a draft-head checkpoint (no {META_FILE}): pass the heads/ "
                                   "directory that `amphista-jax train` wrote")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"line {e.lineno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise DraftCheckpointError(f"{meta_file} is not valid JSON ({where}); re-save the heads or restore that "
                                   "file") from None
    method = meta.get("method") if isinstance(meta, dict) else None
    if method not in DRAFTERS:
        raise DraftCheckpointError(f"{meta_file} names unknown method {method!r}; known: {', '.join(DRAFTERS)}")
    settings, target = meta.get("settings", {}), meta.get("target", {})
    if not isinstance(settings, dict) or not isinstance(target, dict):
        raise DraftCheckpointError(f"{meta_file}: `settings` and `target` must be objects; re-save the heads")
    try:
        drafter = DRAFTERS[method].from_settings(settings)
    except (TypeError, ValueError) as e:
        raise DraftCheckpointError(f"the {method} settings in {meta_file} are invalid ({e}); re-save the heads") \
            from None
    return DraftMeta(method, drafter, target, meta.get("target_sample"))


def params_fit(drafter: Drafter, params: Any, target: Target) -> bool:
    """Whether `params` have the tree and shapes `drafter.init` makes for `target` (so every code path takes them)."""
    want = jax.eval_shape(lambda: drafter.init(jax.random.key(0), target))
    return jax.tree.structure(want) == jax.tree.structure(params) and all(
        a.shape == b.shape for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(params), strict=True))


def load_draft(path: str | Path, target_config: ModelConfig, target_params: dict) -> tuple[str, Drafter, Any]:
    """(method name, drafter, params) from `path`, checked against the target."""
    path = Path(path).absolute()
    meta = read_draft_meta(path)
    method = meta.method
    expected = target_fingerprint(target_config)
    if meta.target != expected:
        diff = {k: (meta.target.get(k), v) for k, v in expected.items() if meta.target.get(k) != v}
        raise DraftCheckpointError(
            f"the {method} heads in {path} were trained for another target (trained for / this target: {diff}); "
            "train heads for this target, or pass the --model they were trained on")
    if meta.target_sample is not None and not np.allclose(target_sample(target_params), meta.target_sample,
                                                          rtol=2**-6, atol=1e-6):
        raise DraftCheckpointError(
            f"the {method} heads in {path} were trained for another target of the same shape (its weights "
            "differ); train heads for this target, or pass the --model they were trained on")
    drafter = meta.drafter
    abstract = jax.eval_shape(lambda: drafter.init(jax.random.key(0), Target(target_config, target_params)))
    # Onto this process's first device: without a sharding orbax restores the saved one, whose devices (heads
    # trained on several processes or devices) need not be here.
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            params = ckpt.restore(path / "params", abstract)
    except Exception as e:  # orbax raises many types for damaged checkpoints
        raise DraftCheckpointError(f"the draft params in {path / 'params'} cannot be restored "
                                   f"({type(e).__name__}: {e}); re-save or retrain the heads") from e
    return method, drafter, params
