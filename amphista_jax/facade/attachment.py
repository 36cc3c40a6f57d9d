"""A drafter attached to a loaded target: its source read once, its params in the decode placement, its tree plan.

An `Attachment` refers to its `LoadedTarget` (never a copy of its weights). `Attachment.attach` reads or initialises
the params once; `on_plan` gives the same drafter and params on another tree plan (what `Generator.with_tree` uses).
A plan chosen on this machine (`auto` with acceptance statistics) is priced by the facade, which can time steps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from amphista_jax.choice.plan import TreePlan
from amphista_jax.drafters import Drafter
from amphista_jax.facade.drafter_source import DrafterSource, draft_model_key, load_draft_params, on_settings_of
from amphista_jax.facade.target import LoadedTarget


@dataclasses.dataclass(frozen=True, eq=False)
class Attachment:
    """`drafter` with its `params` on `target`, drafting the trees `plan` names. `source` is what the drafter was
    read from (its method, path, note and acceptance statistics; its drafter is the one loaded)."""

    target: LoadedTarget
    source: DrafterSource
    params: Any
    plan: TreePlan

    @classmethod
    def attach(cls, target: LoadedTarget, source: DrafterSource, plan: TreePlan, seed: int = 0) -> Attachment:
        """`source`'s drafter on `target`: its params read, checked or initialised with `seed`
        (`drafter_source.load_draft_params`), then placed on the target's mesh. A draft model's are read once per
        target and kept there, shared by every attachment of it (`drafter_source.draft_model_key`)."""
        key = draft_model_key(source, target.dtype)
        if key is not None and key in target.draft_models:
            drafter, params = target.draft_models[key]
            drafter = on_settings_of(source, drafter)
        else:
            drafter, params = load_draft_params(source, target.view, target.model_dir, target.dtype, seed)
            if target.mesh is not None:
                from amphista_jax.engine.sharding import place_for_decoding

                params = place_for_decoding(target.mesh, target.config, target.params, drafter, params)[1]
            if key is not None:
                target.draft_models[key] = drafter, params
        loaded = DrafterSource(source.method, drafter, source.path, source.note, acceptance=source.acceptance)
        return cls(target, loaded, params, plan)

    def on_plan(self, plan: TreePlan) -> Attachment:
        """The same drafter and params (shared, not copied) on `plan`."""
        return Attachment(self.target, self.source, self.params, plan)

    @property
    def drafter(self) -> Drafter:
        return self.source.drafter

    @property
    def method(self) -> str:
        return self.source.method

    @property
    def heads_dir(self) -> str | None:
        """The draft-head checkpoint or draft-model directory the params came from (None: initialised or in hand)."""
        return self.source.path

    @property
    def acceptance(self) -> Path | None:
        return self.source.acceptance
