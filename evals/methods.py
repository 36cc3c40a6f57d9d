"""Method specs of an evaluation run, resolved to programs with identical settings.

A spec is `[label=]source[@tree]`:

* `ar`: the autoregressive baseline (always run, and first).
* a draft-head checkpoint directory (`amphista-jax train` writes `<out_dir>/heads`): any registered method.
* `<method>:untrained`: that method's freshly initialised heads (engine overhead; tau near 1).

`@tree` overrides the run's tree (a preset name or a JSON file of paths). The label names the method in
results and reports (default: `ar`, the method's name, or `<method>-untrained`, plus `@tree` when given).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax

from amphista_jax.decode import generate, speculative_generate
from amphista_jax.drafters import DRAFTERS, Target
from amphista_jax.drafters.io import load_draft
from amphista_jax.trees import TreeSpec, get_tree

AR = "ar"


class MethodSpecError(ValueError):
    """A method spec that names nothing usable."""


@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    spec: str
    method: str  # "ar" or a key of DRAFTERS
    drafter: Any = None
    draft_params: Any = None
    tree: TreeSpec | None = None
    tree_name: str = "-"

    @property
    def tree_nodes(self) -> int:
        return self.tree.num_nodes if self.tree is not None else 0

    def compile(self, params: dict, tokens, lengths, rng, **settings) -> Any:
        """The AOT-compiled program for these shapes; call it with `self.args(params, tokens, lengths, rng)`."""
        if self.drafter is None:
            return generate.lower(*self.args(params, tokens, lengths, rng), **settings).compile()
        return speculative_generate.lower(*self.args(params, tokens, lengths, rng), drafter=self.drafter,
                                          tree=self.tree, **settings).compile()

    def args(self, params: dict, tokens, lengths, rng) -> tuple:
        if self.drafter is None:
            return params, tokens, lengths, rng
        return params, self.draft_params, tokens, lengths, rng

    def describe(self) -> dict[str, Any]:
        settings = dataclasses.asdict(self.drafter) if self.drafter is not None else {}
        choices = [list(p) for p in self.tree.choices] if self.tree is not None else None
        return {"label": self.label, "spec": self.spec, "method": self.method, "tree": self.tree_name,
                "tree_nodes": self.tree_nodes, "tree_choices": choices, "settings": settings}


def split_label(spec: str) -> tuple[str, str]:
    """`label=source[@tree]` -> (label, source[@tree]); a heads path that itself contains `=`
    (`runs/lr=1e-3/heads`) is a source, not a label."""
    label, eq, rest = spec.partition("=")
    if not eq or "/" in label or Path(spec.partition("@")[0]).is_dir():
        return "", spec
    return label, rest


def resolve_method(spec: str, default_tree: str, target: Target, seed: int = 0) -> Method:
    """One spec (see the module docstring) -> Method, with its heads loaded and checked against `target`."""
    label, rest = split_label(spec)
    source, _, tree_name = rest.partition("@")
    if source == AR:
        if tree_name:
            raise MethodSpecError(f"method spec {spec!r}: the AR baseline has no tree")
        return Method(label or AR, spec, AR)
    heads = source if Path(source).is_dir() else None
    tree = get_tree(tree_name or default_tree, heads)
    suffix = f"@{tree_name}" if tree_name else ""
    if source.endswith(":untrained"):
        name = source.removesuffix(":untrained")
        if name not in DRAFTERS:
            raise MethodSpecError(f"method spec {spec!r}: unknown method {name!r}; registered: {', '.join(DRAFTERS)}")
        drafter = DRAFTERS[name]()
        params = jax.jit(drafter.init)(jax.random.key(seed), target)  # one compile beats op-by-op init
        label = label or f"{name}-untrained{suffix}"
        return Method(label, spec, name, drafter, params, tree, tree_name or default_tree)
    if not Path(source).is_dir():
        raise MethodSpecError(f"method spec {spec!r}: {source!r} is neither `ar`, `<method>:untrained` (methods: "
                              f"{', '.join(DRAFTERS)}) nor a draft-head checkpoint directory")
    name, drafter, params = load_draft(source, target.config, target.params)
    return Method(label or f"{name}{suffix}", spec, name, drafter, params, tree, tree_name or default_tree)


def resolve_methods(specs: tuple[str, ...], default_tree: str, target: Target, seed: int = 0) -> list[Method]:
    """The AR baseline first (added when missing), then each spec in order; labels must be unique."""
    ar_specs = [s for s in specs if split_label(s)[1] == AR]
    specs = tuple(s for s in specs if split_label(s)[1] != AR)
    methods = [resolve_method(ar_specs[0] if ar_specs else AR, default_tree, target, seed)]
    methods += [resolve_method(s, default_tree, target, seed) for s in specs]
    labels = [m.label for m in methods]
    if dupes := sorted({x for x in labels if labels.count(x) > 1}):
        raise MethodSpecError(f"method labels {dupes} are used twice: name them, e.g. `medusa-a=runs/a/heads`")
    return methods
