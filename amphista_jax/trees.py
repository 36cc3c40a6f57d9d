"""Draft trees: a hashable `TreeSpec` (Medusa's "choices") and its fixed-size `TreeArrays`.

A tree is a list of paths of top-k ranks below the root: `(0,)` is head 1's best token, `(0, 1)` is head
2's second-best token under it. Nodes are laid out root first, then by (depth, path) as in Medusa's
buffers. For `choices = [(0,), (1,), (0, 0)]` the nodes are `root, (0,), (1,), (0, 0)` and the
ancestor-or-self mask is::

    root   1 0 0 0
    (0,)   1 1 0 0
    (1,)   1 0 1 0
    (0,0)  1 1 0 1

with paths `[[0, 1, 3], [0, 2, -1]]`. Arrays are padded to a fixed node count `N` and path count `P`:
padded nodes see only themselves, are seen by no real node, and lie on no path, so they are never
attended to by, nor accepted into, the real tree.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import struct

from amphista_jax.errors import UserError

PRESET_DIR = Path(__file__).parent / "assets" / "trees"


class TreeError(UserError, ValueError):
    """A draft tree that is not a usable tree."""


@dataclasses.dataclass(frozen=True)
class TreeSpec:
    """A static draft tree: sorted, prefix-closed paths of top-k ranks (the root is implicit)."""

    choices: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        paths = tuple(sorted({tuple(int(i) for i in p) for p in self.choices}, key=lambda p: (len(p), p)))
        if len(paths) != len(self.choices):
            raise TreeError(f"tree has duplicate paths: {len(self.choices) - len(paths)} duplicates")
        for p in paths:
            if not p or min(p) < 0:
                raise TreeError(f"tree path {p} must be a non-empty tuple of top-k ranks >= 0")
            if len(p) > 1 and p[:-1] not in set(paths):
                raise TreeError(f"tree path {p} has no parent {p[:-1]}: every prefix must be a node")
        object.__setattr__(self, "choices", paths)

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return len(self.choices) + 1

    @property
    def depth(self) -> int:
        return max((len(p) for p in self.choices), default=0)

    @property
    def leaves(self) -> tuple[tuple[int, ...], ...]:
        prefixes = {p[:-1] for p in self.choices}
        return tuple(p for p in self.choices if p not in prefixes)

    @property
    def num_paths(self) -> int:
        return max(len(self.leaves), 1)



@struct.dataclass
class TreeArrays:
    """Fixed-size tree description (numpy for static trees, jax arrays for dynamic ones)."""

    head_index: jax.Array  # [N] which head drafted the node (depth - 1; root -1)
    topk_index: jax.Array  # [N] its rank among that head's candidates (root 0)
    parent: jax.Array  # [N] parent node (root and padding: 0)
    depth: jax.Array  # [N] root 0
    mask: jax.Array  # [N, N] bool, ancestor-or-self
    paths: jax.Array  # [P, D + 1] node ids root -> leaf, padded with -1
    valid: jax.Array  # [N] bool, real (not padding) nodes

    @property
    def num_nodes(self) -> int:
        return self.mask.shape[-1]


@functools.lru_cache(maxsize=64)
def tree_arrays(spec: TreeSpec, num_nodes: int | None = None, num_paths: int | None = None) -> TreeArrays:
    """Lay out `spec` padded to `num_nodes` nodes and `num_paths` paths (default: exactly its size)."""
    n = num_nodes or spec.num_nodes
    p = num_paths or spec.num_paths
    if n < spec.num_nodes:
        raise ValueError(f"{num_nodes=} must be >= the tree's {spec.num_nodes} nodes (root included)")
    if p < spec.num_paths:
        raise ValueError(f"{num_paths=} must be >= the tree's {spec.num_paths} root-to-leaf paths")
    index = {(): 0} | {path: i + 1 for i, path in enumerate(spec.choices)}
    head = np.full(n, -1, np.int32)
    topk = np.zeros(n, np.int32)
    parent = np.zeros(n, np.int32)
    depth = np.zeros(n, np.int32)
    mask = np.eye(n, dtype=bool)
    for path, i in index.items():
        if path:
            head[i], topk[i], parent[i], depth[i] = len(path) - 1, path[-1], index[path[:-1]], len(path)
        for d in range(len(path)):
            mask[i, index[path[:d]]] = True
    paths = np.full((p, spec.depth + 1), -1, np.int32)
    leaves = spec.leaves or ((),)
    for row, leaf in enumerate(leaves):
        ids = [index[leaf[:d]] for d in range(len(leaf) + 1)]
        paths[row, : len(ids)] = ids
    valid = np.arange(n) < spec.num_nodes
    return TreeArrays(head, topk, parent, depth, mask, paths, valid)


def chain(depth: int) -> TreeSpec:
    """A single path of each head's top-1 token (`depth` draft tokens)."""
    return TreeSpec(tuple((0,) * d for d in range(1, depth + 1)))


def load_tree(path: str | Path) -> TreeSpec:
    """A tree from a JSON list of paths (e.g. `[[0], [0, 0], [1]]`) with at least one draft node."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise TreeError(f"tree file {path} is not JSON ({e.msg} at line {e.lineno}, column {e.colno}): it must "
                        "hold a list of paths, e.g. [[0], [1], [0, 0]]") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TreeError(f"tree file {path} cannot be read ({e}): pass a JSON file of paths") from None
    if not isinstance(data, list) or not all(isinstance(p, list) and all(isinstance(i, int) for i in p)
                                             for p in data):
        raise TreeError(f"{path} must hold a JSON list of paths of integer ranks, e.g. [[0], [1], [0, 0]]")
    if not data:
        raise TreeError(f"tree file {path} has no draft nodes (an empty tree is autoregressive decoding): add "
                        "paths, e.g. [[0], [1], [0, 0]], or use a preset")
    return TreeSpec(tuple(tuple(p) for p in data))


PRESETS: dict[str, TreeSpec] = {
    "mc_sim_7b_63": load_tree(PRESET_DIR / "medusa_mc_sim_7b_63.json"),
    "chain-1": chain(1),
    "chain-4": chain(4),
    "small-8": TreeSpec(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
    "small-16": TreeSpec(((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0),
                          (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0))),
}


AUTO = "auto"
AUTO_FALLBACK = "mc_sim_7b_63"  # `auto` without a tree searched for these heads on this device class


def searched_tree_path(heads_dir: str | Path, backend: str | None = None) -> Path:
    """Where `amphista-jax tree-search` writes the tree searched for these heads on this device class."""
    return Path(heads_dir) / "trees" / f"{backend or jax.default_backend()}.json"


def get_tree(name_or_path: str, heads_dir: str | Path | None = None) -> TreeSpec:
    """A preset by name, a JSON file of paths, or `auto`: the tree searched for the heads in `heads_dir` on this
    device class (`amphista-jax tree-search`), else the papers' tree, with a note on stderr."""
    if name_or_path == AUTO:
        path = searched_tree_path(heads_dir) if heads_dir is not None else None
        if path is not None and path.is_file():
            return load_tree(path)
        why = (f"no tree was searched for {heads_dir} on {jax.default_backend()} (`amphista-jax tree-search --heads "
               f"{heads_dir}` searches one)" if heads_dir is not None else "untrained heads have no searched tree")
        print(f"note: tree auto: {why}; using {AUTO_FALLBACK}", file=sys.stderr)
        return PRESETS[AUTO_FALLBACK]
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.startswith("chain-") and name_or_path[6:].isdigit() and int(name_or_path[6:]) >= 1:
        return chain(int(name_or_path[6:]))
    if Path(name_or_path).is_file():
        return load_tree(name_or_path)
    raise TreeError(f"unknown tree {name_or_path!r}: use a preset ({', '.join(PRESETS)}, chain-N) or a JSON file "
                    "of paths")
