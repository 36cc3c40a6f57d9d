"""The tree plan: which tree a drafter drafts at batch size b, and why, for every way a tree is named.

A `TreePlan` is the one answer to that question. It holds one of:
- a tree named for every batch size (a preset, a JSON file of paths, a `TreeSpec` / `TreeBudget`);
- a table of a tree per batch size (`TreePolicy`: a tree search's result, read from its policy file), None where the
  search predicted no tree faster than autoregressive decoding;
- `auto` with acceptance statistics: candidate trees with their measured tau (`acceptance`), chosen per batch size on
  this machine from the step costs `price(batch)` times here (`calibration`), each batch size decided once.

Every choice between a tree and plain decoding is `decide`'s one rule: a candidate's predicted speed-up is its
measured tau x this machine's AR step / its step; of the candidates predicted faster than AR by more than their
margin (the larger of the noise of their step's estimate and `MIN_MARGIN`), the fastest, else no speculation. `auto`
and tree search both decide by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from amphista_jax.choice.acceptance import Acceptance
from amphista_jax.infra.errors import UserError
from amphista_jax.trees.names import TreePolicy
from amphista_jax.trees.tree import Tree

MIN_MARGIN = 0.03  # the least margin over AR a tree must be predicted to beat it by, whatever the measured noise


class PlanError(UserError, ValueError):
    """A plan asked what it cannot answer (step costs that time no candidate)."""


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """What one decode step costs on this machine at `batch` rows: AR's, and each candidate's (None: not timed,
    as no larger tree could win), with each candidate's noise and the timed pairs it took (`calibration`)."""

    batch: int
    ar_ms: float
    step_ms: tuple[float | None, ...]  # per candidate of the acceptance statistics, in their order
    noise: tuple[float | None, ...]  # per candidate: the relative spread of its step cost's estimate
    seconds: float  # the calibration's wall time, compiles included
    pairs: tuple[int | None, ...] = ()  # per candidate: the interleaved (AR, candidate) timings it took

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepCosts:
        def floats(xs: Sequence[float | None]) -> tuple[float | None, ...]:
            return tuple(None if x is None else float(x) for x in xs)

        return cls(int(d["batch"]), float(d["ar_ms"]), floats(d["step_ms"]), floats(d["noise"]), float(d["seconds"]),
                   tuple(None if n is None else int(n) for n in d["pairs"]))


@dataclasses.dataclass(frozen=True)
class Decision:
    """The rule's answer at one batch size: a candidate (its index) or no speculation (None), and why."""

    batch: int
    index: int | None
    speedups: tuple[float | None, ...]  # predicted, per candidate (None: not timed)
    margins: tuple[float | None, ...]  # per candidate: it must be predicted faster than AR by more than this

    @property
    def best(self) -> int:
        """The candidate with the largest predicted speed-up (chosen or not)."""
        return max((i for i, s in enumerate(self.speedups) if s is not None), key=lambda i: self.speedups[i])

    @property
    def margin(self) -> float:
        """The margin of the candidate chosen, or, with none, of the best."""
        return self.margins[self.best if self.index is None else self.index]

    def describe(self, acceptance: Acceptance) -> str:
        if self.index is None:
            c, s = acceptance.candidates[self.best], self.speedups[self.best]
            return (f"auto: no speculation at batch {self.batch} on this machine (best candidate {c.name}, tau "
                    f"{c.tau:.2f}, predicted {s:.2f}x: not above 1 + its {self.margin:.0%} noise margin)")
        c, s = acceptance.candidates[self.index], self.speedups[self.index]
        return f"auto: {c.name} ({c.nodes} draft nodes, tau {c.tau:.2f}) at batch {self.batch}, predicted {s:.2f}x here"


def decide(batch: int, taus: Sequence[float], ar_step: float, steps: Sequence[float | None],
           noise: Sequence[float | None] | None = None, min_margin: float = MIN_MARGIN) -> Decision:
    """The rule: each candidate's predicted speed-up, tau x `ar_step` / its step (None where not timed), and its
    margin, the larger of its `noise` (none: 0) and `min_margin`; the fastest of those predicted faster than AR by
    more than their margin, else no speculation."""
    speedups = tuple(None if s is None else t * ar_step / s for t, s in zip(taus, steps, strict=True))
    if all(s is None for s in speedups):
        raise PlanError("no candidate tree was timed: calibrate again")
    noise = [0.0] * len(steps) if noise is None else noise
    margins = tuple(None if s is None else max(n or 0.0, min_margin) for s, n in zip(speedups, noise, strict=True))
    winners = [i for i, s in enumerate(speedups) if s is not None and s > 1 + margins[i]]
    return Decision(batch, max(winners, key=lambda i: speedups[i]) if winners else None, speedups, margins)


def choose(acceptance: Acceptance, costs: StepCosts, min_margin: float = MIN_MARGIN) -> Decision:
    """`decide` on `acceptance`'s candidates and a calibration's step costs (their noise in the margin)."""
    return decide(costs.batch, [c.tau for c in acceptance.candidates], costs.ar_ms, costs.step_ms, costs.noise,
                  min_margin)


@dataclasses.dataclass(frozen=True, eq=False)
class TreePlan:
    """Which tree at each batch size, and why (see the module docstring). `tree` is the tree before any batch size is
    asked for (a table's first; None under `auto`); `price` is set once the target has loaded (`Generator`'s
    `_with_plan`, under `load`, `with_drafter` and `with_tree`)."""

    name: str  # the tree as it was named: `auto`, `small-8`, a file
    tree: Tree | None = None
    table: TreePolicy | None = None
    acceptance: Acceptance | None = None
    note: str | None = None  # how the name was resolved, for the front-end to print as `note: <note>`
    price: Callable[[int], StepCosts] | None = dataclasses.field(default=None, repr=False)
    decisions: dict[int, Decision] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def chooses_here(self) -> bool:
        """Whether the trees are chosen on this machine (`auto` with acceptance statistics)."""
        return self.acceptance is not None

    def named_trees(self) -> set[Tree]:
        """The trees the plan names outright (the tree, a table's): what the drafter is checked against up front."""
        return {self.tree, *(t for _, t in (self.table.by_batch if self.table else ()))} - {None}

    def priced(self, price: Callable[[int], StepCosts]) -> TreePlan:
        """This plan with this machine's step costs at a batch size (`auto` decides from them)."""
        return dataclasses.replace(self, price=price, decisions={})

    def decision(self, batch: int) -> Decision:
        """`auto`'s decision at `batch` rows (step costs timed on first use of that batch size)."""
        if self.acceptance is None or self.price is None:
            raise PlanError(f"tree {self.name} is not chosen on this machine: it has no step costs to decide from")
        if batch not in self.decisions:
            self.decisions[batch] = choose(self.acceptance, self.price(batch))
        return self.decisions[batch]

    def at(self, batch: int) -> Tree | None:
        """The tree at `batch` rows; None: no speculation."""
        if self.chooses_here:
            d = self.decision(batch)
            return None if d.index is None else self.acceptance.candidates[d.index].tree
        return self.table.at(batch) if self.table is not None else self.tree

    def label(self, batch: int) -> str:
        """Short, for a results table: `auto: <candidate>` / `auto: none`, a table's entry at `batch`, or the name."""
        if self.chooses_here:
            d = self.decision(batch)
            return f"auto: {'none' if d.index is None else self.acceptance.candidates[d.index].name}"
        if self.table is not None:
            tree = self.table.at(batch)
            return f"{self.name}: " + ("no speculation" if tree is None else f"{tree.num_nodes - 1} nodes") + \
                f" at batch {batch}"
        return self.name

    def describe(self, batch: int) -> str:
        """Why `auto` chose the tree at `batch` rows here: its predicted speed-up against the margin."""
        return self.decision(batch).describe(self.acceptance)
