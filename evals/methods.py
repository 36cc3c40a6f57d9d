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

`resolve_methods` checks every spec and reads each checkpoint's `draft.json` (cheap: no params, no target);
`load_methods` then loads or initialises the heads against the target.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax
import yaml

from amphista_jax.drafters import DRAFTERS, Drafter
from amphista_jax.drafters.draft_model import DraftModel, DraftModelError
from amphista_jax.drafters.io import META_FILE, DraftCheckpointError, load_draft, params_fit, read_draft_meta
from amphista_jax.errors import UserError
from amphista_jax.generator import Generator
from amphista_jax.identity import heads_identity, target_identity
from amphista_jax.models.hf import load_config
from amphista_jax.target import Target
from amphista_jax.tree_names import AUTO, resolve_tree
from amphista_jax.trees import Tree, TreeBudget, TreeSpec

AR = "ar"
DRAFT_MODEL = "draft-model"


class MethodSpecError(UserError, ValueError):
    """A method spec that names nothing usable."""


@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    spec: str
    method: str  # "ar", a key of DRAFTERS or DRAFT_MODEL
    drafter: Drafter | None = None
    draft_params: Any = None
    tree: Tree | None = None  # a static tree, or the budget of trees the drafter grows (EAGLE-2)
    tree_name: str = "-"
    heads_dir: str | None = None  # the draft-head checkpoint or draft model; None for `ar` and untrained heads
    heads_files: dict[str, str] | None = None  # sha256 of each of its files (amphista_jax.identity)

    @property
    def tree_nodes(self) -> int:
        return self.tree.num_nodes if self.tree is not None else 0

    def generator(self, base: Generator) -> Generator:
        """`base` (the target's autoregressive generator) with this method's drafter and tree."""
        if self.drafter is None:
            return base
        return dataclasses.replace(base, drafter=self.drafter, draft_params=self.draft_params, tree=self.tree,
                                   tree_name=self.tree_name, method=self.method, heads_dir=self.heads_dir,
                                   programs={})

    def describe(self) -> dict[str, Any]:
        settings = dataclasses.asdict(self.drafter) if self.drafter is not None else {}
        choices = [list(p) for p in self.tree.choices] if isinstance(self.tree, TreeSpec) else None
        budget = dataclasses.asdict(self.tree) if isinstance(self.tree, TreeBudget) else None
        return {"label": self.label, "spec": self.spec, "method": self.method, "tree": self.tree_name,
                "tree_nodes": self.tree_nodes, "tree_choices": choices, "tree_budget": budget,
                "settings": settings} | (
                    {"heads_files": self.heads_files} if self.heads_dir is not None else {})


def split_label(spec: str) -> tuple[str, str]:
    """`label=source[@tree]` -> (label, source[@tree]); a heads path that itself contains `=`
    (`runs/lr=1e-3/heads`) is a source, not a label."""
    label, eq, rest = spec.partition("=")
    if not eq or any(c in label for c in "/#") or Path(spec.partition("@")[0]).is_dir():  # `=` of a path or setting
        return "", spec
    return label, rest


def resolve_method(spec: str, default_tree: str, target: Target | None = None, seed: int = 0,
                   temperature: float = 0.0, batch: int = 1) -> Method:
    """One spec (see the module docstring) -> Method for a run at `temperature` and `batch` rows (`auto` picks
    its tree by it; where tree search found no tree faster than AR there, the method decodes autoregressively);
    with `target`, its heads loaded and checked against it, else only checked (`load_methods` loads them)."""
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
    heads = source if Path(source).is_dir() else None
    model = heads is not None and (Path(source) / "config.json").is_file() and not (Path(source) / META_FILE).is_file()
    name, drafter, identity = _drafter(spec, source, heads, model, overrides)
    if model and not tree_name and default_tree == AUTO:  # a draft model has no searched tree: its paper's, quietly
        tree_name = drafter.paper_tree
    try:
        tree, note = resolve_tree(tree_name or default_tree, heads, drafter.paper_tree, batch)
        if tree is None:  # `auto`: no tree beats AR at this batch size on this device
            print(f"note: {note}", file=sys.stderr)
            return Method(label or name + (f"@{tree_name}" if tree_name else ""), spec, name,
                          tree_name=f"{tree_name or default_tree}: none at batch {batch}")
        # a draft model samples its drafts at the run's temperature on static trees (`#temperature=0`: top-k)
        drafter = _with_settings(spec, drafter.sampling_at(temperature, tree), overrides)
        drafter.check_tree(tree)
    except (UserError, ValueError) as e:
        raise MethodSpecError(f"method spec {spec!r}: {e}") from None
    if note:
        print(f"note: {note}", file=sys.stderr)
    if isinstance(drafter, DraftModel) and drafter.temperature > 0 and not isinstance(tree, TreeSpec):
        raise MethodSpecError(f"method spec {spec!r}: a dynamic tree keeps the top drafts, not samples: drop "
                              "#temperature or use a static tree")
    suffix = f"@{tree_name}" if tree_name else ""
    label = label or (f"{name}-untrained{suffix}" if source.endswith(":untrained") else f"{name}{suffix}")
    method = Method(label, spec, name, drafter, None, tree, tree_name or default_tree, heads_dir=heads,
                    heads_files=identity)
    return load_methods([method], target, seed)[0] if target is not None else method


def _drafter(spec: str, source: str, heads: str | None, model: bool, overrides: str
             ) -> tuple[str, Drafter, dict[str, str] | None]:
    """(method name, drafter with the spec's settings, sha256 of its files or None) of a spec's source: heads
    made by the method's `init` when asked for as untrained, or for a method with nothing to train (prompt lookup)."""
    name = source.removesuffix(":untrained")
    if heads is None and name in DRAFTERS and (source.endswith(":untrained") or not DRAFTERS[name].trainable):
        return name, _with_settings(spec, DRAFTERS[name](), overrides), None
    if source.endswith(":untrained"):
        raise MethodSpecError(f"method spec {spec!r}: unknown method {name!r}; registered: {', '.join(DRAFTERS)}")
    if heads is None:
        raise MethodSpecError(f"method spec {spec!r}: {source!r} is neither `ar`, `<method>:untrained` (methods: "
                              f"{', '.join(DRAFTERS)}), a draft-head checkpoint directory nor a model directory")
    if model:
        return DRAFT_MODEL, DraftModel(load_config(source)), target_identity(source)
    name, drafter = _read_meta(spec, Path(source))
    return name, _with_settings(spec, drafter, overrides), heads_identity(source)


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


def with_settings(spec: str, drafter: Drafter, settings: dict[str, Any]) -> Any:
    """`drafter` with `settings` changed, each checked by the method's `from_settings`."""
    if not settings:
        return drafter
    try:
        return type(drafter).from_settings({f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)}
                                           | settings)
    except (TypeError, ValueError) as e:
        raise MethodSpecError(f"method spec {spec!r}: {e}") from None


def _with_settings(spec: str, drafter: Drafter, overrides: str) -> Any:
    """`drafter` with the spec's `key=value,...` settings (YAML values)."""
    return with_settings(spec, drafter, parse_settings(spec, overrides))


def _read_meta(spec: str, heads: Path) -> tuple[str, Drafter]:
    """(method name, drafter) from a checkpoint's draft.json, without its params."""
    try:
        meta = read_draft_meta(heads)
    except DraftCheckpointError as e:
        raise MethodSpecError(f"method spec {spec!r}: {e}") from None
    return meta.method, meta.drafter


def load_methods(methods: list[Method], target: Target, seed: int = 0) -> list[Method]:
    """Each method with its draft params: restored from its checkpoint (checked against `target`) or freshly
    initialised (untrained)."""
    out = []
    for m in methods:
        if m.drafter is None or m.draft_params is not None:
            out.append(m)
        elif m.method == DRAFT_MODEL:
            try:
                _, params = DraftModel.from_pretrained(m.heads_dir, target.config)
            except DraftModelError as e:
                raise MethodSpecError(f"method spec {m.spec!r}: {e}") from None
            out.append(dataclasses.replace(m, draft_params=params))
        elif m.heads_dir is None:
            params = jax.jit(m.drafter.init)(jax.random.key(seed), target)  # one compile beats op-by-op init
            out.append(dataclasses.replace(m, draft_params=params))
        else:
            name, _, params = load_draft(m.heads_dir, target.config, target.params)
            if not params_fit(m.drafter, params, target):
                raise MethodSpecError(f"method spec {m.spec!r}: its settings change the heads' parameters; override "
                                      "only decoding settings")
            out.append(dataclasses.replace(m, method=name, draft_params=params))
    return out


def resolve_methods(specs: tuple[str, ...], default_tree: str, target: Target | None = None, seed: int = 0,
                    temperature: float = 0.0, batch: int = 1) -> list[Method]:
    """The AR baseline first (the first `ar` spec, added when missing), then each other spec in order, for a run at
    `temperature`; labels must be unique. A later `ar` spec stays where it is: AR timed again at that point of the run,
    whose speed-up against the first is the run's timing noise. Without `target` the heads are checked but not loaded
    (see `load_methods`)."""
    first = next((k for k, s in enumerate(specs) if split_label(s)[1] == AR), None)
    rest = [s for k, s in enumerate(specs) if k != first]
    methods = [resolve_method(AR if first is None else specs[first], default_tree, None, seed)]
    methods += [resolve_method(s, default_tree, None, seed, temperature, batch) for s in rest]
    labels = [m.label for m in methods]
    if dupes := sorted({x for x in labels if labels.count(x) > 1}):
        raise MethodSpecError(f"method labels {dupes} are used twice: name them, e.g. `medusa-a=runs/a/heads`")
    return load_methods(methods, target, seed) if target is not None else methods
