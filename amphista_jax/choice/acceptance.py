"""Acceptance statistics: what a head set's drafts are worth, measured once and shipped with the heads.

Acceptance belongs to the heads (and the target, and the kind of text), not to the machine that decodes, so it is
measured once, where the heads are made, and kept beside them as `acceptance.json`: a short list of candidate trees,
each with its mean accept length tau (tokens committed per decode step, greedy) on calibration prompts kept apart
from every evaluation set. Step costs are the machine's: `calibration` measures them where the heads decode, and
`auto` picks from both.

Candidates, in ascending number of draft nodes (so ascending step cost):
- a drafter that drafts static trees: the trees grown from its per-(depth, rank) acceptance rates
  (`tree_search.grow_trees`) at `CANDIDATE_NODES` draft nodes, then its paper's tree;
- a drafter that only grows its tree on device every step (Gumiho): the budgets `CANDIDATE_BUDGETS` its checks
  accept, then its paper's budget.
Every candidate's tau is measured by decoding the calibration prompts on it, not predicted from the rates (the
rates' independence assumption overstates a bushy tree's tau).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from amphista_jax.infra.errors import UserError
from amphista_jax.infra.output_lock import write_atomic
from amphista_jax.trees.names import get_tree
from amphista_jax.trees.tree import Tree, TreeError, TreeSpec

ACCEPTANCE_FILE = "acceptance.json"
CANDIDATE_NODES = (1, 2, 4, 8, 16)  # static candidates: grown trees of these many draft nodes
CANDIDATE_BUDGETS = ("dynamic-4x3x2", "dynamic-8x4x4", "dynamic-16x5x8", "dynamic-24x4x10", "dynamic-40x5x10")


class AcceptanceError(UserError, ValueError):
    """An acceptance file that cannot be read."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A tree `auto` may pick, with its measured tau (tokens per decode step, greedy, on the calibration prompts)."""

    name: str  # `grown-N` (N draft nodes grown from the rates) or a tree name (`dynamic-8x4x4`, `mc_sim_7b_63`)
    tree: Tree
    tau: float

    @property
    def nodes(self) -> int:
        """Draft nodes (the root not counted): what a verify forward pays for."""
        return self.tree.num_nodes - 1

    def to_json(self) -> dict[str, Any]:
        paths = [list(p) for p in self.tree.choices] if isinstance(self.tree, TreeSpec) else None
        return {"name": self.name, "nodes": self.nodes, "tau": round(self.tau, 4), "paths": paths}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Candidate:
        tree = TreeSpec(tuple(tuple(p) for p in d["paths"])) if d["paths"] is not None else get_tree(d["name"])
        return cls(str(d["name"]), tree, float(d["tau"]))


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """A head set's acceptance statistics (`acceptance.json` beside the heads)."""

    method: str
    measured_on: str  # the calibration prompts and settings, in words
    candidates: tuple[Candidate, ...]  # ascending draft nodes
    rates: tuple[tuple[float, ...], ...] = ()  # per (depth, rank), the static candidates' source; () for budgets

    def __post_init__(self) -> None:
        if not self.candidates:
            raise AcceptanceError(f"{self.method}: acceptance statistics need at least one candidate tree")

    @property
    def best_tau(self) -> float:
        return max(c.tau for c in self.candidates)

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "measured_on": self.measured_on,
                "candidates": [c.to_json() for c in self.candidates], "rates": [list(r) for r in self.rates]}

    def write(self, path: str | Path) -> Path:
        return write_atomic(path, json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> Acceptance:
        try:
            d = json.loads(Path(path).read_text())
            return cls(str(d["method"]), str(d["measured_on"]),
                       tuple(Candidate.from_json(c) for c in d["candidates"]),
                       tuple(tuple(float(x) for x in r) for r in d.get("rates", ())))
        except (OSError, ValueError, KeyError, TypeError, TreeError) as e:
            raise AcceptanceError(f"acceptance statistics {path} cannot be read ({type(e).__name__}: {e}): measure "
                                  "them again with `amphista-jax calibrate --acceptance`, or name a tree (--tree)"
                                  ) from None


def acceptance_file(heads_dir: str | Path | None) -> Path | None:
    """The acceptance file of the heads (or draft model, or shipped method directory) at `heads_dir`, if any."""
    path = Path(heads_dir) / ACCEPTANCE_FILE if heads_dir is not None else None
    return path if path is not None and path.is_file() else None


def candidate_trees(tree_kinds: tuple[type, ...], paper_tree: str, grown: Sequence[TreeSpec],
                    check: Callable[[Tree], None]) -> list[tuple[str, Tree]]:
    """(name, tree) of the candidates (see the module docstring): `grown[i]` is the grown tree of `i + 1` draft
    nodes (static drafters), `check` a drafter's `check_tree` (budgets it refuses are left out)."""
    out: list[tuple[str, Tree]] = []
    if TreeSpec in tree_kinds:
        out = [(f"grown-{n}", grown[n - 1]) for n in CANDIDATE_NODES if n <= len(grown)]
    else:
        for name in CANDIDATE_BUDGETS:
            try:
                check(get_tree(name))
            except TreeError:
                continue
            out.append((name, get_tree(name)))
    paper = get_tree(paper_tree)
    if paper not in [t for _, t in out]:
        out.append((paper_tree, paper))
    return sorted(out, key=lambda c: c[1].num_nodes)


def mean_tau(new_tokens: np.ndarray, steps: np.ndarray) -> float:
    """Tokens committed per decode step over many rows: (new tokens - the prefill's one) / steps, summed."""
    return float((np.sum(new_tokens) - np.size(new_tokens)) / max(int(np.sum(steps)), 1))


PROMPT_SETS = ("sharegpt", "humaneval", "both")  # held-out calibration prompts (`tree_search.calibration_prompts`)


def is_chat_target(model_dir: str | Path, tokenizer: Any) -> bool:
    """Whether the target answers chat turns (a chat template, and not the embedded code model, which completes
    code): what its demo, calibration and acceptance prompts look like."""
    from amphista_jax.assets import DEFAULT_MODEL
    from amphista_jax.models.fetch import shipped_target

    return shipped_target(model_dir) != DEFAULT_MODEL and bool(tokenizer.chat_template)
