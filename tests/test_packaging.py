"""The installed package's shape: recipes and evals live under `amphista_jax`, imports point one way, and every
third-party import is a declared dependency."""

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = [ROOT / "amphista_jax", ROOT / "pallas_kernels"]
RECIPES = ("amphista_jax.train", "amphista_jax.evals")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


COMMANDS = {ROOT / "amphista_jax" / "cli.py", ROOT / "amphista_jax" / "recipe.py"}  # `recipe`: trains, measures


def test_the_library_never_imports_recipes_or_evals():
    """library <- recipes/evals <- commands: only the commands (the CLI, and the recipe command that runs training
    and measurement in turn) may reach the training recipes and the evaluation harness."""
    offenders = {}
    for folder in LIBRARY:
        for path in folder.rglob("*.py"):
            if path in COMMANDS:
                continue
            bad = {m for m in _imported_modules(path) if m.startswith(RECIPES) or m.split(".")[0] in ("train", "evals")}
            if bad:
                offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders


def test_no_top_level_train_or_evals_outside_the_checkout(tmp_path):
    """Outside the source tree (cwd elsewhere, no PYTHONPATH) the install exposes amphista_jax.train and
    amphista_jax.evals, and no top-level `train` or `evals` package."""
    code = (
        "import importlib.util as u, amphista_jax.train.heads, amphista_jax.evals.runner, "
        "amphista_jax.evals.benchmarks.step_time\n"
        "print(u.find_spec('train'), u.find_spec('evals'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "None"]


def _requirement_names(requirements: list[str]) -> set[str]:
    """Canonical distribution names of PEP 508 requirement strings."""
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group()).lower() for r in requirements}


def test_every_third_party_import_of_the_package_is_a_declared_dependency():
    """Each module the package installs imports, at any depth, only the standard library, itself, and distributions
    `pyproject.toml` declares: the runtime dependencies, or for the benchmarks also the `bench` extra, or for the
    reference engines (`evals/peer_engines`) the `peers` extra and the pinned reference packages. A newcomer's
    `pip install -e .` then has every import the package reaches (a dependency reached only through another package,
    like jinja2 through transformers' chat templates, is run by `.ci/newcomer` in a venv with no extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = _requirement_names(project["dependencies"])
    bench = runtime | _requirement_names(project["optional-dependencies"]["bench"])
    pinned = (ROOT / "tests" / "reference-packages.txt").read_text().splitlines()
    peers = (runtime | _requirement_names(project["optional-dependencies"]["peers"])
             | _requirement_names(line.split()[0] for line in pinned if line and not line.startswith("#")))
    owners = importlib.metadata.packages_distributions()
    undeclared = {}
    for folder in (*LIBRARY, ROOT / "train", ROOT / "evals"):
        for path in folder.rglob("*.py"):
            allowed = bench if "benchmarks" in path.parts else peers if "peer_engines" in path.parts else runtime
            for top in {m.split(".")[0] for m in _imported_modules(path)}:
                if top in sys.stdlib_module_names or top in ("amphista_jax", "pallas_kernels"):
                    continue
                dists = _requirement_names(owners.get(top, [top]))
                if not dists & allowed:
                    undeclared.setdefault(str(path.relative_to(ROOT)), []).append(f"{top} ({', '.join(dists)})")
    assert not undeclared, undeclared
