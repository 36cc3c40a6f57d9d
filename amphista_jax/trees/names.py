"""Trees by name: presets (`mc_sim_7b_63`, `chain-N`, `small-8`, ...), JSON files of paths, BiTA's `efficient-DxK`,
`fan-KxD` (K chains of D tokens from the root), dynamic budgets (`dynamic`, `dynamic-TxDxK`), tree policy files
(`<stem>.batch.json`: `amphista-jax tree-search`'s tree per batch size) and `auto`.

`auto` for heads with acceptance statistics is chosen on the machine that decodes (`calibration`, through
`drafter_source.choose_tree`); here it is only the fallback for heads without them: the tree their paper drafts,
passed in by the caller (this module knows no drafter), with a note that the front-end prints (`note: tree auto:
<why>; using <fallback>` on stderr); `get_tree` itself prints nothing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax

from amphista_jax.trees.growth import dynamic_tree
from amphista_jax.trees.tree import Tree, TreeError, TreeSpec, chain, efficient_tree, fan

PRESET_DIR = Path(__file__).parents[1] / "assets" / "trees"


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
PAPER_TREE = "mc_sim_7b_63"  # what a method drafts unless its paper names another tree (a drafter's `paper_tree`)


def searched_tree_path(heads_dir: str | Path, backend: str | None = None) -> Path:
    """Where `amphista-jax tree-search` writes the tree it searched for these heads on this device class (by
    default; decode on it with `--tree <path>`)."""
    return Path(heads_dir) / "trees" / f"{backend or jax.default_backend()}.json"


DYNAMIC = "dynamic"  # EAGLE-2's budget with the paper's defaults; `dynamic-TxDxK` sets them
EFFICIENT = "efficient"  # `efficient-DxK`: BiTA's efficient tree of depth D, top-K per depth
FAN = "fan"  # `fan-KxD`: the root's top K children, each followed by a chain of D - 1 first children


def _sizes(name: str, kind: str, what: str, form: str, example: str) -> list[int]:
    """The sizes in a tree name `<kind>-<form>` (positive integers joined by `x`, e.g. `dynamic-60x6x10`)."""
    sizes = name[len(kind) + 1:].split("x")
    if len(sizes) == form.count("x") + 1 and all(s.isascii() and s.isdigit() and int(s) >= 1 for s in sizes):
        return [int(s) for s in sizes]
    raise TreeError(f"tree {name!r}: {what} reads {kind}-{form} (each >= 1), e.g. {kind}-{example}")


POLICY_SUFFIX = ".batch.json"  # a tree policy file, beside the tree tree search picked at its smallest batch size


def is_policy_file(name_or_path: str) -> bool:
    """Whether a tree name is a tree policy file (`<stem>.batch.json`, as `tree-search --out <stem>.json` writes for a
    method without heads, such as prompt lookup), which resolves by the batch at hand as `auto` does."""
    return name_or_path.endswith(POLICY_SUFFIX) and Path(name_or_path).is_file()


@dataclasses.dataclass(frozen=True)
class TreePolicy:
    """The tree tree search picked at each batch size it measured; None where no tree was predicted to beat
    autoregressive decoding by more than the tree plan's margin (no speculation)."""

    by_batch: tuple[tuple[int, TreeSpec | None], ...]  # ascending batch sizes

    def __post_init__(self) -> None:
        sizes = [b for b, _ in self.by_batch]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise TreeError(f"a tree policy needs distinct ascending batch sizes >= 1, got {sizes}")

    def at(self, batch: int) -> TreeSpec | None:
        """The entry of the largest measured batch size <= `batch` (the smallest one's below them all)."""
        return [t for b, t in self.by_batch if b <= batch][-1] if batch >= self.by_batch[0][0] else self.by_batch[0][1]

    def to_json(self) -> dict[str, Any]:
        return {"batch_sizes": {str(b): None if t is None else [list(p) for p in t.choices] for b, t in self.by_batch}}

    @classmethod
    def read(cls, path: str | Path) -> TreePolicy:
        try:
            sizes = json.loads(Path(path).read_text())["batch_sizes"]
            return cls(tuple(sorted((int(b), None if paths is None else TreeSpec(tuple(tuple(p) for p in paths)))
                                    for b, paths in sizes.items())))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise TreeError(f"tree policy {path} cannot be read ({type(e).__name__}: {e}): run `amphista-jax "
                            "tree-search --replace` again, or delete it to use the heads' paper tree") from None

    def describe(self) -> str:
        return ", ".join(f"batch {b}: " + ("no speculation" if t is None else f"{t.num_nodes - 1} nodes")
                         for b, t in self.by_batch)


def read_policy(tree: str) -> TreePolicy | None:
    """The tree policy a policy file (`<stem>.batch.json`) holds; None for any other tree name."""
    return TreePolicy.read(tree) if is_policy_file(tree) else None


def resolve_auto(heads_dir: str | Path | None = None, paper_tree: str = PAPER_TREE) -> tuple[Tree, str]:
    """What `auto` means for heads without acceptance statistics (with them, `auto` is chosen on the machine that
    decodes: `calibration`): `paper_tree`, the tree the heads' paper drafts (the drafter's `paper_tree`;
    `PAPER_TREE` without heads), with a note saying why for the front-end to print as `note: <note>`."""
    why = (f"no acceptance statistics for {heads_dir} (`amphista-jax calibrate --acceptance --heads {heads_dir}` "
           "measures them)" if heads_dir is not None else "no acceptance statistics ship for these heads here")
    return get_tree(paper_tree), f"tree auto: {why}; using {paper_tree}"


def resolve_tree(name_or_path: str, heads_dir: str | Path | None = None, paper_tree: str = PAPER_TREE,
                 batch: int = 1) -> tuple[Tree | None, str | None]:
    """(the tree `name_or_path` names, a policy file resolved at `batch` rows: None for no speculation; the note
    `auto` without acceptance statistics leaves for the front-end to print as `note: <note>`, or None)."""
    if name_or_path == AUTO:
        return resolve_auto(heads_dir, paper_tree)
    if is_policy_file(name_or_path):
        tree = TreePolicy.read(name_or_path).at(batch)
        return tree, None if tree is not None else f"tree {name_or_path}: no speculation at batch {batch}"
    return get_tree(name_or_path), None


def get_tree(name_or_path: str, heads_dir: str | Path | None = None, paper_tree: str = PAPER_TREE) -> Tree:
    """A preset by name, a JSON file of paths, `auto` without acceptance statistics (`resolve_auto`: `paper_tree`,
    the tree of the heads' paper; `resolve_tree` also returns the note saying so), BiTA's efficient tree
    `efficient-DxK`, a fan of K chains of D tokens `fan-KxD`, or the budget of a tree
    grown on device every step: `dynamic` (60 nodes, depth 6, top-10) or `dynamic-TxDxK`."""
    if name_or_path == AUTO:
        return resolve_auto(heads_dir, paper_tree)[0]
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if is_policy_file(name_or_path):
        raise TreeError(f"{name_or_path} holds a tree per batch size: resolve it at the batch at hand (resolve_tree)")
    if Path(name_or_path).is_file():
        return load_tree(name_or_path)
    if name_or_path.startswith("chain-") and name_or_path[6:].isdigit() and int(name_or_path[6:]) >= 1:
        return chain(int(name_or_path[6:]))
    if name_or_path == DYNAMIC:
        return dynamic_tree()
    if name_or_path.startswith(DYNAMIC + "-"):
        return dynamic_tree(*_sizes(name_or_path, DYNAMIC, "a dynamic budget (drafted nodes x depth x top-k)",
                                   "TxDxK", "60x6x10"))
    if name_or_path.startswith(EFFICIENT + "-"):
        return efficient_tree(*_sizes(name_or_path, EFFICIENT, "an efficient tree (depth x top-k)", "DxK", "3x5"))
    if name_or_path.startswith(FAN + "-"):
        return fan(*_sizes(name_or_path, FAN, "a fan (chains x tokens each)", "KxD", "2x4"))
    raise TreeError(f"unknown tree {name_or_path!r}: use a preset ({', '.join(PRESETS)}, chain-N, efficient-DxK, "
                    "fan-KxD), a JSON file of paths, or a dynamic budget (dynamic, dynamic-TxDxK)")
