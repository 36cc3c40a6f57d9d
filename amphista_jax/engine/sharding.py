"""Meshes and shardings. Model code names logical axes only; this module maps them to mesh axes.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel + parameter sharding on `embed`), `tensor`
(model parallel over heads / MLP / vocab).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from amphista_jax.drafters.base import Drafter, draft_param_shapes
from amphista_jax.infra.errors import UserError
from amphista_jax.models.cache import KVCache
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import param_shapes
from amphista_jax.models.param_layout import has_split_layers
from amphista_jax.models.target import Target

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("length", None),
    ("layers", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("norm", None),
)


class MeshError(UserError, ValueError):
    """Mesh sizes that do not fit the devices."""


@contextlib.contextmanager
def on_mesh(mesh: Mesh, rules: Sequence = LOGICAL_RULES) -> Iterator[None]:
    """Run jitted decoding (`generate`, `speculative_generate`) sharded over `mesh`: the logical constraints of
    the model code (activations) and of the engine (KV caches: rows over the batch axes, KV heads over
    `tensor`) resolve through `rules`. Pass params placed by `place_for_decoding`."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `(data, fsdp, tensor)` mesh with `Auto` axes (Linen's logical constraints need them) over `devices`
    (default: all); `MeshError` unless the sizes multiply to their count."""
    devices = list(devices if devices is not None else jax.devices())
    if data * fsdp * tensor != len(devices):
        raise MeshError(f"mesh {data=} x {fsdp=} x {tensor=} = {data * fsdp * tensor} devices, but "
                         f"{len(devices)} are available: choose sizes whose product is the device count")
    grid = np.asarray(devices).reshape(data, fsdp, tensor)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _fit(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes from dimensions they do not divide (e.g. 2 KV heads on a tensor axis of 4)."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=True):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
        out.append(axes if names and dim % size == 0 else None)
    return PartitionSpec(*out)


def logical_sharding(logical: PartitionSpec, shape: tuple[int, ...], mesh: Mesh,
                     rules: Sequence = LOGICAL_RULES) -> NamedSharding:
    mesh_spec = nn.logical_to_mesh_axes(tuple(logical), rules)
    return NamedSharding(mesh, _fit(mesh_spec, shape, mesh))


def param_shardings(config: ModelConfig, mesh: Mesh, rules: Sequence = LOGICAL_RULES, split: bool = False) -> dict:
    """A tree like the target params (`split`: in decoding's `split_layers` layout) of `NamedSharding`s from
    their logical axes."""
    return _shardings(*param_shapes(config, split=split), mesh, rules)


def draft_param_shardings(drafter: Drafter, target: Target, mesh: Mesh, rules: Sequence = LOGICAL_RULES) -> Any:
    """A tree like `drafter.init`'s params of `NamedSharding`s from their logical axes (`draft_param_shapes`),
    under the target's rules."""
    return _shardings(*draft_param_shapes(drafter, target), mesh, rules)


def place_for_decoding(mesh: Mesh, config: ModelConfig, params: dict, drafter: Drafter | None = None,
                       draft_params: Any = None, rules: Sequence = LOGICAL_RULES) -> tuple[dict, Any]:
    """(target params, draft params) on `mesh` by their logical axes, for `generate` / `speculative_generate` under
    `on_mesh(mesh)`: the target in its layout (decoding's per-layer one, or stacked), the drafter's params by its
    `init_boxed` axes (replicated without). Without `drafter` (AR) the draft params come back as None. Arrays already
    placed so are not copied again (one target serves every drafter). Draft params in the layout `Drafter.kept_params`
    makes of `init`'s (a draft model's int8 projections with their row scales) are placed as XLA shards the output of
    `kept_params` when its input is placed by its logical axes; any other layout is a `MeshError` naming both."""
    params = jax.device_put(params, param_shardings(config, mesh, rules, split=has_split_layers(params)))
    if drafter is None:
        return params, None
    target = Target(config, params)
    shardings = draft_param_shardings(drafter, target, mesh, rules)
    if jax.tree.structure(draft_params) != jax.tree.structure(shardings):
        shapes = draft_param_shapes(drafter, target)[0]
        shardings = jax.jit(drafter.kept_params, in_shardings=(shardings,)).lower(shapes).compile().output_shardings
        if jax.tree.structure(draft_params) != jax.tree.structure(shardings):
            raise MeshError(f"the {type(drafter).__name__} params given are neither in its init layout nor as it "
                            "keeps them (kept_params): pass them as the drafter loads them")
    return params, jax.device_put(draft_params, shardings)


def _shardings(shapes: Any, logical: Any, mesh: Mesh, rules: Sequence) -> Any:
    """`NamedSharding`s of a tree of shapes from its tree of logical `PartitionSpec`s."""
    return jax.tree.map(lambda s, spec: logical_sharding(spec, s.shape, mesh, rules), shapes, logical,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def train_state_shardings(drafter: Drafter, target: Target, optimizer: optax.GradientTransformation, mesh: Mesh,
                          rules: Sequence = LOGICAL_RULES) -> dict:
    """Shardings of the draft train state `{"params", "opt_state", "step"}`: each parameter by its logical axes,
    the optimizer's per-parameter state (Adam's moments) like its parameter, everything else (counters)
    replicated."""
    shapes, logical = draft_param_shapes(drafter, target)
    params = _shardings(shapes, logical, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    by_path = {_dict_keys(path): (leaf.shape, sharding) for (path, leaf), sharding in
               zip(jax.tree_util.tree_flatten_with_path(shapes)[0], jax.tree.leaves(params), strict=True)}

    def like_its_param(path: tuple, leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        # A per-parameter state leaf (Adam's mu, nu) ends in its parameter's dict path, under the state's own
        # (non-dict) containers; anything else (step counts) is replicated.
        shape, sharding = by_path.get(_dict_keys(path), (None, replicated))
        return sharding if shape == leaf.shape else replicated

    opt_state = jax.tree_util.tree_map_with_path(like_its_param, jax.eval_shape(optimizer.init, shapes))
    return {"params": params, "opt_state": opt_state, "step": replicated}


def _dict_keys(path: tuple) -> tuple:
    """The dict keys after the last non-dict entry of a pytree key path (a parameter's path in a nested-dict
    params tree)."""
    start = max((i + 1 for i, k in enumerate(path) if not isinstance(k, jax.tree_util.DictKey)), default=0)
    return tuple(k.key for k in path[start:])


def batch_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Shard the leading (batch) dimension over `data` x `fsdp`, replicate the rest."""
    return NamedSharding(mesh, _fit(PartitionSpec(BATCH_AXES), shape, mesh))


def local_batch_shards(mesh: Mesh) -> tuple[range, int]:
    """(the batch shards this process's devices hold, of the mesh's data x fsdp): a batch shard's devices differ
    only along `tensor`, and may span processes, which then hold (and read) the same rows."""
    shards = mesh.devices.reshape(-1, mesh.shape["tensor"])  # [data x fsdp, tensor]
    mine = [i for i, row in enumerate(shards) if any(d.process_index == jax.process_index() for d in row)]
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise ValueError(f"process {jax.process_index()} holds batch shards {mine}, not consecutive ones: order the "
                         "mesh's devices by process")
    return range(mine[0], mine[-1] + 1), len(shards)


def process_batch_rows(mesh: Mesh | None, rows: int) -> slice:
    """The rows of a global batch of `rows` (split over `data` x `fsdp`) that this process feeds: those its devices
    hold. Without a mesh, all."""
    if mesh is None:
        return slice(0, rows)
    mine, ways = local_batch_shards(mesh)
    return slice(mine.start * rows // ways, mine.stop * rows // ways)


def cache_sharding(mesh: Mesh, cache: KVCache) -> KVCache:
    """KV cache `[L, B, S, KVH, Dh]`: batch over `data` x `fsdp`, KV heads over `tensor`."""
    kv = NamedSharding(mesh, _fit(PartitionSpec(None, BATCH_AXES, None, "tensor"), cache.k.shape, mesh))
    return KVCache(kv, kv, batch_sharding(mesh, cache.lengths.shape))
