"""Hugging Face checkpoint I/O: `config.json` + `*.safetensors` <-> Flax params, without torch.

Loading reads each tensor (or, with shardings, only each device's slice of it) straight from the
memory-mapped safetensors files, so a sharded model never exists as one full host copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from amphista_jax.infra.errors import UserError
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import param_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"checkpoint": None, "bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
LAYOUTS = ("stacked", "split")  # the target's layer layouts (`load_params`)

LAYER_TENSORS = {  # our path under `layers` -> HF name under `model.layers.{i}.`, transposed?
    ("attn", "q_proj", "kernel"): ("self_attn.q_proj.weight", True),
    ("attn", "k_proj", "kernel"): ("self_attn.k_proj.weight", True),
    ("attn", "v_proj", "kernel"): ("self_attn.v_proj.weight", True),
    ("attn", "o_proj", "kernel"): ("self_attn.o_proj.weight", True),
    ("attn", "q_proj", "bias"): ("self_attn.q_proj.bias", False),
    ("attn", "k_proj", "bias"): ("self_attn.k_proj.bias", False),
    ("attn", "v_proj", "bias"): ("self_attn.v_proj.bias", False),
    ("attn", "o_proj", "bias"): ("self_attn.o_proj.bias", False),
    ("mlp", "gate_proj", "kernel"): ("mlp.gate_proj.weight", True),
    ("mlp", "up_proj", "kernel"): ("mlp.up_proj.weight", True),
    ("mlp", "down_proj", "kernel"): ("mlp.down_proj.weight", True),
    ("mlp", "gate_proj", "bias"): ("mlp.gate_proj.bias", False),
    ("mlp", "up_proj", "bias"): ("mlp.up_proj.bias", False),
    ("mlp", "down_proj", "bias"): ("mlp.down_proj.bias", False),
    ("input_norm", "scale"): ("input_layernorm.weight", False),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", False),
}
_TOP_TENSORS = {
    ("embed", "embedding"): ("model.embed_tokens.weight", False),
    ("final_norm", "scale"): ("model.norm.weight", False),
    ("lm_head", "kernel"): ("lm_head.weight", True),
}


class CheckpointError(UserError, ValueError):
    """A checkpoint directory that cannot be loaded, with what is wrong and how to fix it."""


def load_config(path: str | Path) -> ModelConfig:
    return ModelConfig.from_json(_checkpoint_dir(path) / "config.json")


def param_dtype(path: str | Path, dtype: str) -> Any:
    """The dtype `load_params(path, dtype)` gives the params: `dtype`, or for "checkpoint" the `torch_dtype` that
    config.json records (float32 when it records none)."""
    if DTYPES[dtype] is not None:
        return DTYPES[dtype]
    stored = json.loads((_checkpoint_dir(path) / "config.json").read_text()).get("torch_dtype") or "float32"
    return DTYPES.get(stored) or jnp.float32


def _checkpoint_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a Hugging Face checkpoint: it has no config.json "
            "(point --model at the directory that holds config.json and *.safetensors)")
    return path


def _weight_map(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it."""
    if (path / INDEX_FILE).is_file():
        try:
            index = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{path / INDEX_FILE} is not a valid safetensors index ({e})") from e
        files = {name: path / f for name, f in index.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"{INDEX_FILE} names shard {f.name!r}, which is missing from {path}")
        return files
    if (path / SINGLE_FILE).is_file():
        with _open(path / SINGLE_FILE) as f:
            return {name: path / SINGLE_FILE for name in f.keys()}
    hint = " (PyTorch .bin checkpoints are not supported: re-save with safe_serialization=True)" if list(
        path.glob("*.bin")) else ""
    raise CheckpointError(f"{path} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


@contextlib.contextmanager
def _open(file: Path) -> Iterator[Any]:
    try:
        with safe_open(str(file), framework="numpy") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"{file} is corrupt or truncated ({e}); re-download or re-save it") from e


def _out_major(path: tuple[str, ...], transposed: bool) -> tuple[tuple[str, ...], bool]:
    """A path and orientation of the stacked layout in `split_layers`' (a kernel `[in, out]` as its `weight [out,
    in]`, HF's own orientation)."""
    return (path[:-1] + ("weight",), False) if path[-1] == "kernel" else (path, transposed)


def _hf_layout(config: ModelConfig) -> dict[tuple[str, ...], tuple[str, bool, bool]]:
    """Our param path, in either layout (stacked `layers` or `split_layers`' `layer_i`) -> (HF name or name
    template, transposed, stacked over layers)."""
    layout: dict[tuple[str, ...], tuple[str, bool, bool]] = {}
    for path, (name, t) in _TOP_TENSORS.items():
        layout[path] = (name, t, False)
        split_path, split_t = _out_major(path, t)
        layout[split_path] = (name, split_t, False)
    for path, (name, t) in LAYER_TENSORS.items():
        layout[("layers",) + path] = ("model.layers.{}." + name, t, True)
        split_path, split_t = _out_major(path, t)
        layout |= {(f"layer_{i}",) + split_path: (f"model.layers.{i}." + name, split_t, False)
                   for i in range(config.num_layers)}
    return layout


def _flatten(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flatten(v, prefix + (k,))
        else:
            out[prefix + (k,)] = v
    return out


def _unflatten(flat: dict[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def load_params(
    path: str | Path,
    config: ModelConfig | None = None,
    dtype: str = "checkpoint",
    shardings: dict | None = None,
    layout: str = "stacked",
) -> tuple[dict, ModelConfig]:
    """Load a local HF checkpoint into (params, config).

    `dtype`: "checkpoint" keeps each tensor's stored dtype; "bfloat16" / "float32" / "float16" cast.
    `shardings`: a tree like the params of `jax.sharding.Sharding`s; each device then reads only its slice.
    `layout`: "stacked" (the layers on one leading axis: training) or "split" (`param_layout.split_layers`' one tree
    per layer: decoding), read straight into that layout.
    """
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if layout not in LAYOUTS:
        raise CheckpointError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    path = _checkpoint_dir(path)
    config = config or load_config(path)
    weight_map = _weight_map(path)
    shapes, _ = param_shapes(config, split=layout == "split")
    flat_shapes = _flatten(shapes)
    flat_shardings = _flatten(shardings) if shardings is not None else {}
    names_of = _hf_layout(config)
    cast = DTYPES[dtype]
    out = {}
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def tensor(name: str) -> Any:
            if name not in weight_map:
                raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {path}")
            file = weight_map[name]
            if file not in handles:
                handles[file] = stack.enter_context(_open(file))
            try:
                return handles[file].get_slice(name)
            except SafetensorError as e:
                raise CheckpointError(f"{file} is corrupt or truncated ({e}); re-download or re-save it") from e

        for key, spec in flat_shapes.items():
            name, transposed, stacked = names_of[key]
            per_layer = tuple(reversed(spec.shape[1:])) if transposed and stacked else (
                spec.shape[1:] if stacked else (tuple(reversed(spec.shape)) if transposed else spec.shape))
            names = [name.format(i) for i in range(config.num_layers)] if stacked else [name]
            slices = [tensor(n) for n in names]
            for n, s in zip(names, slices, strict=True):
                if tuple(s.get_shape()) != tuple(per_layer):
                    raise CheckpointError(
                        f"tensor {n!r} has shape {tuple(s.get_shape())} but config.json implies "
                        f"{tuple(per_layer)}: the weights do not match the config in {path}")
            read = _reader(slices, transposed, stacked)
            target_dtype = cast or _np_dtype(slices[0].get_dtype())
            if key in flat_shardings:
                out[key] = jax.make_array_from_callback(
                    spec.shape, flat_shardings[key], lambda idx, r=read, d=target_dtype: r(idx).astype(d))
            else:
                full = tuple(slice(None) for _ in spec.shape)
                out[key] = jnp.asarray(read(full).astype(target_dtype))
    return _unflatten(out), config


def _np_dtype(safetensors_dtype: str) -> np.dtype:
    return {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64}[
        safetensors_dtype]


def _reader(slices: list[Any], transposed: bool, stacked: bool) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """A function from an index into our (possibly stacked, transposed) array to that region, as numpy."""
    def one(s: Any, idx: tuple[slice, ...]) -> np.ndarray:
        if transposed:
            return np.asarray(s[tuple(reversed(idx))]).T
        return np.asarray(s[idx])

    def read(idx: tuple[slice, ...]) -> np.ndarray:
        idx = tuple(idx)
        if not stacked:
            return one(slices[0], idx)
        layers = range(len(slices))[idx[0]]
        return np.stack([one(slices[i], idx[1:]) for i in layers])

    return read


def save_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """`safetensors.numpy.save_file` whose failures of the machine (no space, read-only: its Rust error names the
    OS error) are the OSErrors they are, so the CLI reports them as one line with its machine-refusal exit."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None


def save_params(
    params: dict,
    config: ModelConfig,
    path: str | Path,
    dtype: str = "bfloat16",
    max_shard_bytes: int | None = None,
) -> Path:
    """Save params as a HF checkpoint (`config.json` + safetensors, sharded with an index when over
    `max_shard_bytes`) that `transformers` loads as the same architecture.

    `dtype`: "checkpoint" keeps each array's own dtype (as `load_params(dtype="checkpoint")` read it);
    "bfloat16" / "float32" / "float16" cast. `config.json`'s `torch_dtype` is the dtype of most bytes."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cast = DTYPES[dtype]
    tensors: dict[str, np.ndarray] = {}
    names_of = _hf_layout(config)
    for key, value in _flatten(params).items():
        name, transposed, stacked = names_of[key]
        arr = np.asarray(jax.device_get(value))
        if cast is not None:
            arr = arr.astype(cast)
        for i, layer in enumerate(arr if stacked else [arr]):
            tensors[name.format(i)] = np.ascontiguousarray(layer.T if transposed else layer)
    hf = config.to_hf_dict()
    nbytes: dict[str, int] = {}
    for arr in tensors.values():
        nbytes[str(arr.dtype)] = nbytes.get(str(arr.dtype), 0) + arr.nbytes
    hf["torch_dtype"] = max(nbytes, key=nbytes.get)
    hf["dtype"] = hf["torch_dtype"]
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    for stale in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_safetensors(shards[0], path / SINGLE_FILE)
        return path
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(shard, path / fname)
        weight_map |= {name: fname for name in shard}
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return path
