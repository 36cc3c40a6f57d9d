"""Method specs of an evaluation run, resolved to programs with identical settings.

A spec is `[label=]source[@tree][#key=value,...]`:

* `ar`: the autoregressive baseline (always run, and first); a second, labelled `ar` spec (`ar-end=ar` last) times AR
  again at that point of the run: its speed-up against the first is the run's timing noise.
* a draft-head checkpoint directory (`amphista-jax train` writes `<out_dir>/heads`): any registered method.
* `<method>:untrained`: that method's freshly initialised heads (engine overhead; tau near 1).
* `<method>` alone for a method with nothing to train (`prompt_lookup`): the method itself.
* a Hugging Face model directory (`config.json`, no `draft.json`): that model as a draft model
  (`drafters/draft_model.py`; it must share the target's vocabulary). `@tree` defaults to chain-4. At a
  temperature > 0 on a static tree a draft model's drafts (this one's, or a trained `draft_model`'s) are drawn at
  that temperature (classic speculative sampling); `#temperature=0` keeps top-k drafts.

`@tree` overrides the run's tree (a preset name, a JSON file of paths or a dynamic budget). `#key=value,...`
overrides decoding settings of the method that leave its parameters as they are (e.g. Gumiho's
`#full_tree_attention=false`). The label names the method in
results and reports (default: `ar`, the method's name, or `<method>-untrained`, plus `@tree` when given). With
`auto`, untrained heads and methods with nothing to train draft their paper's tree (the drafter's `paper_tree`).

`resolve_methods` checks every spec through `drafter_source` (the one home of heads and trees; cheap: no params
read); `Method.generator` then attaches each to the target with `Generator.with_drafter`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import yaml

from amphista_jax.choice.plan import TreePlan
from amphista_jax.drafters import Drafter
from amphista_jax.drafters.draft_model import DraftModel
from amphista_jax.facade.drafter_source import (
    UNTRAINED,
    DrafterSource,
    choose_tree,
    read_source,
    with_settings,
)
from amphista_jax.facade.generator import Generator
from amphista_jax.infra.errors import UserError
from amphista_jax.infra.identity import heads_identity, json_digest, target_identity
from amphista_jax.models.config import ModelConfig
from amphista_jax.trees.names import AUTO
from amphista_jax.trees.tree import Tree, TreeBudget, TreeSpec

AR = "ar"
DRAFT_MODEL = "draft-model"


CHOSEN = ("tree", "tree_nodes", "tree_choices", "tree_budget")  # what `auto` decides only once the target has loaded


class MethodSpecError(UserError, ValueError):
    """A method spec that names nothing usable."""


@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    spec: str
    method: str  # "ar", a key of DRAFTERS or DRAFT_MODEL
    source: DrafterSource | None = None  # the drafter as the spec resolved it for the run (None: AR)
    tree: Tree | None = None  # a static tree, or the budget of trees the drafter grows (EAGLE-2)
    tree_name: str = "-"
    heads_files: dict[str, str] | None = None  # sha256 of each of its files (amphista_jax.infra.identity)
    choice: TreePlan | None = None  # `auto` from acceptance statistics: the tree is chosen once the target loads

    @property
    def drafter(self) -> Drafter | None:
        drafts = self.tree is not None or self.choice is not None
        return self.source.drafter if self.source is not None and drafts else None

    @property
    def heads_dir(self) -> str | None:
        """The draft-head checkpoint or draft model; None for `ar` and untrained heads."""
        return self.source.path if self.source is not None else None

    @property
    def tree_nodes(self) -> int:
        return self.tree.num_nodes if self.tree is not None else 0

    def generator(self, base: Generator, seed: int = 0) -> Generator:
        """`base` (the target's autoregressive generator) with this method's drafter (its params loaded or
        initialised with `seed`) on its tree (`auto`: chosen on this machine, per batch size: `for_batch`), or
        `base` itself for AR."""
        if self.drafter is None:
            return base
        try:
            return base.with_drafter(self.source, self.choice or TreePlan(self.tree_name, self.tree), seed=seed)
        except UserError as e:
            raise MethodSpecError(f"method spec {self.spec!r}: {e}") from None

    def chosen(self, gen: Generator, batch: int) -> Method:
        """This method as `gen` (its `generator`) decodes `batch` rows: the tree `auto` chose on this machine
        (None: no speculation), named `auto: <candidate>`."""
        if self.choice is None or gen.policy is None or not gen.policy.chooses_here:
            return self
        return dataclasses.replace(self, tree=gen.policy.at(batch), tree_name=gen.policy.label(batch), choice=None)

    def describe(self) -> dict[str, Any]:
        """What a run records of this method (`run.json`, summary.json): its drafter's settings, a draft vocabulary
        as its size and digest; `auto` not yet chosen leaves out the tree (`CHOSEN`)."""
        settings = dataclasses.asdict(self.source.drafter) if self.source is not None else {}
        if vocab := settings.get("draft_vocab"):  # 32,768 ids a method would repeat in every record: their digest
            settings["draft_vocab"] = {"ids": len(vocab), "sha256": json_digest(list(vocab))}
        choices = [list(p) for p in self.tree.choices] if isinstance(self.tree, TreeSpec) else None
        budget = dataclasses.asdict(self.tree) if isinstance(self.tree, TreeBudget) else None
        tree = {"tree": self.tree_name, "tree_nodes": self.tree_nodes, "tree_choices": choices, "tree_budget": budget}
        return {"label": self.label, "spec": self.spec, "method": self.method, "settings": settings} | (
            {} if self.choice is not None else tree) | (
                {"heads_files": self.heads_files} if self.heads_dir is not None else {})


def split_label(spec: str) -> tuple[str, str]:
    """`label=source[@tree]` -> (label, source[@tree]); a heads path that itself contains `=`
    (`runs/lr=1e-3/heads`) is a source, not a label."""
    label, eq, rest = spec.partition("=")
    if not eq or any(c in label for c in "/#") or Path(spec.partition("@")[0]).is_dir():  # `=` of a path or setting
        return "", spec
    return label, rest


def resolve_method(spec: str, default_tree: str, config: ModelConfig | None = None, model_dir: str | None = None,
                   temperature: float = 0.0, batch: int = 1) -> Method:
    """One spec (see the module docstring) -> Method for a run of the target of `config` (checked against its
    vocabulary) at `model_dir` (the heads shipped for it), at `temperature` and `batch` rows (a tree policy file
    picks its tree by it, where it says none the method decodes autoregressively; `auto` with acceptance statistics
    is chosen once the target has loaded, `Method.chosen`). Reads and checks; loads no params (`Method.generator`
    does)."""
    label, rest = split_label(spec)
    rest, _, overrides = rest.partition("#")
    source, at, tree_name = rest.partition("@")
    if at and not tree_name:
        raise MethodSpecError(f"method spec {spec!r} names an empty tree after `@`: name one (e.g. `@small-8`, "
                              "`@auto`) or drop the `@` for the run's default tree")
    if not source:
        raise MethodSpecError(f"method spec {spec!r} names no source: use `ar`, `<method>:untrained` or a "
                              "draft-head checkpoint directory")
    if source == AR:
        if tree_name:
            raise MethodSpecError(f"method spec {spec!r}: the AR baseline has no tree")
        return Method(label or AR, spec, AR)
    untrained = source.endswith(UNTRAINED)
    try:
        found = read_source(source, model_dir, config)
        if found.path is None and found.drafter.trainable and not untrained:
            raise MethodSpecError(f"no {source} heads are shipped for this target: give a draft-head checkpoint "
                                  f"directory, or `{source}{UNTRAINED}` for its untrained heads")
        name = DRAFT_MODEL if found.is_model_dir else found.method
        if found.is_model_dir and not tree_name and default_tree == AUTO and found.acceptance is None:  # quietly
            tree_name = found.drafter.paper_tree
        vocab = config.vocab_size if config is not None else None
        choice = choose_tree(tree_name or default_tree, found, vocab)
        # chosen here once the target has loaded (a draft model's drafts then stay top-k: lossless at any temperature)
        if choice.acceptance is not None:
            drafter = with_settings(found.drafter, parse_settings(spec, overrides))
            return Method(_label(label, name, untrained, tree_name), spec, name,
                          dataclasses.replace(found, drafter=drafter, note=None), None, AUTO, _identity(found), choice)
        tree = choice.at(batch)
        if tree is None:  # a tree policy file: no tree beats AR at this batch size
            print(f"note: tree {tree_name or default_tree}: no speculation at batch {batch} (the tree search that "
                  "wrote it predicted no tree faster than autoregressive decoding by its margin)", file=sys.stderr)
            return Method(label or name + (f"@{tree_name}" if tree_name else ""), spec, name,
                          tree_name=f"{tree_name or default_tree}: none at batch {batch}")
        # a draft model samples its drafts at the run's temperature on static trees (`#temperature=0`: top-k)
        adapted = with_settings(found.drafter.sampling_at(temperature, tree), parse_settings(spec, overrides))
        adapted.check_tree(tree, vocab)
    except (UserError, ValueError) as e:
        raise MethodSpecError(f"method spec {spec!r}: {e}") from None
    if choice.note:
        print(f"note: {choice.note}", file=sys.stderr)
    if isinstance(adapted, DraftModel) and adapted.temperature > 0 and not isinstance(tree, TreeSpec):
        raise MethodSpecError(f"method spec {spec!r}: a dynamic tree keeps the top drafts, not samples: drop "
                              "#temperature or use a static tree")
    return Method(_label(label, name, untrained, tree_name), spec, name,
                  dataclasses.replace(found, drafter=adapted, note=None), tree, tree_name or default_tree,
                  _identity(found))


def _label(label: str, name: str, untrained: bool, tree_name: str) -> str:
    """The label a spec gives, else `<method>[-untrained][@tree]`."""
    suffix = f"@{tree_name}" if tree_name else ""
    return label or (f"{name}-untrained{suffix}" if untrained else f"{name}{suffix}")


def _identity(found: DrafterSource) -> dict[str, str] | None:
    """sha256 of each file of the heads or draft model (None: nothing on disk)."""
    if found.path is None:
        return None
    return target_identity(found.path) if found.is_model_dir else heads_identity(found.path)


def parse_settings(spec: str, overrides: str) -> dict[str, Any]:
    """A spec's `key=value,...` settings (YAML values); `{}` for none."""
    settings = {}
    for item in filter(None, overrides.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise MethodSpecError(f"method spec {spec!r}: setting {item!r} must look like key=value (e.g. "
                                  "#full_tree_attention=false)")
        settings[key.strip()] = yaml.safe_load(value)
    return settings


def resolve_methods(specs: tuple[str, ...], default_tree: str, config: ModelConfig | None = None,
                    model_dir: str | None = None, temperature: float = 0.0, batch: int = 1) -> list[Method]:
    """The AR baseline first (the first `ar` spec, added when missing), then each other spec in order, for a run at
    `temperature`; labels must be unique. A later `ar` spec stays where it is: AR timed again at that point of the run,
    whose speed-up against the first is the run's timing noise. Checks every spec; loads no params."""
    first = next((k for k, s in enumerate(specs) if split_label(s)[1] == AR), None)
    rest = [s for k, s in enumerate(specs) if k != first]
    methods = [resolve_method(AR if first is None else specs[first], default_tree, config, model_dir)]
    methods += [resolve_method(s, default_tree, config, model_dir, temperature, batch) for s in rest]
    labels = [m.label for m in methods]
    if dupes := sorted({x for x in labels if labels.count(x) > 1}):
        raise MethodSpecError(f"method labels {dupes} are used twice: name them, e.g. `medusa-a=runs/a/heads`")
    return methods
