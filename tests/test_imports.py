"""The first-party import graph, read from the source: it has no cycles, the kernels import nothing from the
library, and each wing imports only the wings below it (`WINGS`, drawn in docs/architecture.md).

Nodes are the modules of `amphista_jax` and `pallas_kernels`, with `train/` and `evals/` under the names they
install as (`[tool.setuptools.package-dir]` in pyproject.toml). An edge is any `import` / `from ... import` of
a first-party module, at module level or inside a function: a function-level import runs later, so it breaks
no import at start-up, but it is still an arrow between layers, and a circle drawn with one (`trees.names.get_tree`
importing the drafters, which import `trees`) is still a circle in the design. Importing `a.b.c` also runs
`a/__init__.py` and `a/b/__init__.py`, so those packages are edges too, except the importer's own packages
(already being imported when it runs, unless it names one of them itself: `from a import name` inside a.b).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("amphista_jax", "pallas_kernels")


def _package_dirs() -> dict[str, Path]:
    """Package name -> its source folder: the top-level packages, then pyproject's package-dir mapping."""
    dirs = {name: ROOT / name for name in FIRST_PARTY}
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs |= {name: ROOT / folder for name, folder in setuptools.get("package-dir", {}).items()}
    return dirs


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (source file, is a package)."""
    modules = {}
    for package, folder in _package_dirs().items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            if parts and parts[-1] == "__init__":
                name = ".".join((package, *parts[:-1]))
            # A subfolder mapped elsewhere (amphista_jax.train -> train/) is found under its own mapping.
            if name not in modules or parts[-1:] == ("__init__",):
                modules[name] = (path, parts[-1:] == ("__init__",))
    return modules


def _imported(name: str, path: Path, is_package: bool, modules: dict) -> set[str]:
    """The first-party modules `name` (in `path`) imports anywhere in its source."""
    found = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package, `level - 1` packages up
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` where a.b.c is a name inside a.b
                target = target.rpartition(".")[0]
            if not target:
                continue
            if target != name:
                found.add(target)
            parts = target.split(".")
            for i in range(1, len(parts)):  # the packages above it, which the import runs first
                step = ".".join(parts[:i])
                if step in modules and step != name and not name.startswith(step + "."):
                    found.add(step)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, is_package, modules) for name, (path, is_package) in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (`a -> b -> ... -> a`) through each strongly connected component of more than one module."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for component in components:  # a shortest cycle from the component's first module, by breadth-first search
        start = min(component)
        parent, frontier = {start: None}, [start]
        while frontier:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w == start:
                        path = [v]
                        while parent[path[-1]] is not None:
                            path.append(parent[path[-1]])
                        found.append(path[::-1] + [start])
                        nxt = []
                        break
                    if w not in parent:
                        parent[w] = v
                        nxt.append(w)
                else:
                    continue
                break
            frontier = nxt
    return found


def test_the_graph_is_read():
    graph = import_graph()
    assert {"amphista_jax.trees.tree", "amphista_jax.trees.names", "amphista_jax.train.step",
            "amphista_jax.evals.runner", "pallas_kernels.tree_attention"} <= graph.keys()
    assert "amphista_jax.trees.tree" in graph["amphista_jax.trees.growth"]
    assert "amphista_jax.convert" in graph["amphista_jax.cli"]  # a function-level import counts
    assert "amphista_jax.drafters" in graph["amphista_jax.drafters.io"]  # `from pkg import name`: the package
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_kernels_import_nothing_from_the_library():
    graph = import_graph()
    offenders = {m: sorted(t for t in targets if t.startswith("amphista_jax"))
                 for m, targets in graph.items() if m.startswith("pallas_kernels")}
    assert not {m: t for m, t in offenders.items() if t}


# The wings, lowest first, and the wings each may import besides itself: `amphista_jax/<wing>/`, the recipes and the
# evaluation (`train/`, `evals/`), the kernels, and the modules directly in `amphista_jax/` (the commands, the demo,
# the package's face) as `top`, with the prompt sets (`amphista_jax/prompts.py`) on their own below evaluation.
WINGS: dict[str, set[str]] = {
    "kernels": set(),
    "infra": set(),
    "assets": set(),
    "prompts": {"infra"},
    "models": {"kernels", "infra", "assets"},
    "trees": {"infra"},
    "drafters": {"kernels", "infra", "models", "trees"},
    "engine": {"kernels", "infra", "models", "trees", "drafters"},
    "choice": {"infra", "assets", "models", "trees", "drafters", "engine"},
    "train": {"infra", "assets", "models", "trees", "drafters", "engine"},
    "facade": {"infra", "assets", "models", "trees", "drafters", "engine", "choice"},
    "evals": {"kernels", "infra", "assets", "prompts", "models", "trees", "drafters", "engine", "choice", "train",
              "facade"},
}
WINGS["top"] = set(WINGS)
TOP_LEVEL_MODULES = 12  # at most this many modules directly in amphista_jax/, its __init__ included


def wing_of(module: str) -> str:
    """The wing a first-party module belongs to."""
    parts = module.split(".")
    if parts[0] == "pallas_kernels":
        return "kernels"
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS):
        return parts[1]
    return "prompts" if parts[1:] == ["prompts"] else "top"


def test_every_wing_imports_only_the_wings_below_it():
    graph = import_graph()
    offenders = sorted(f"{m} ({wing_of(m)}) imports {t} ({wing_of(t)})" for m, targets in graph.items()
                       for t in targets if wing_of(t) != wing_of(m) and wing_of(t) not in WINGS[wing_of(m)])
    assert not offenders, "imports against the wing rule:\n" + "\n".join(offenders)


def test_the_wings_are_the_folders():
    graph = import_graph()
    folders = {m.split(".")[1] for m in graph if m.startswith("amphista_jax.") and m.count(".") >= 2}
    assert folders <= WINGS.keys(), f"folders with no wing: {sorted(folders - WINGS.keys())}"
    top = [m for m in graph if wing_of(m) in ("top", "prompts") and m.startswith("amphista_jax")]
    assert len(top) <= TOP_LEVEL_MODULES, f"{len(top)} modules directly in amphista_jax/: {sorted(top)}"
    assert wing_of("amphista_jax.engine.decode") == "engine" and wing_of("amphista_jax.cli") == "top"
    assert wing_of("amphista_jax.evals.benchmarks.roofline") == "evals" and wing_of("pallas_kernels") == "kernels"
