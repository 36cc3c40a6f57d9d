"""Where a drafter comes from, and which tree it drafts: the one home of both decisions.

`read_source` turns what a user names (a draft-head directory, a method name, the heads shipped for the target, a
method's untrained heads, a draft model's directory, or a `Drafter` in hand) into a `DrafterSource`: the method, its
drafter with its settings, and where its params are, read without loading any params. `choose_tree` makes the
`TreePlan` of the trees it drafts (a name, a file, `auto`, a tree policy searched per batch size), checked against
the drafter and the target's vocabulary. `load_draft_params` then reads or initialises the params against the loaded
target. `Generator.load` and `Generator.with_drafter` attach what they read; the CLI, tree search and evaluation read
a source through `read_source` too, and attach it through them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax

from amphista_jax.choice.acceptance import Acceptance, AcceptanceError, acceptance_file
from amphista_jax.choice.plan import TreePlan
from amphista_jax.drafters import VARIANTS, Drafter
from amphista_jax.drafters.draft_model import DraftModel, check_vocabularies
from amphista_jax.drafters.io import META_FILE, load_draft, params_fit, read_draft_meta
from amphista_jax.infra.errors import GeneratorError
from amphista_jax.infra.output_lock import write_atomic
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.target import Target
from amphista_jax.trees.names import AUTO, get_tree, read_policy, resolve_tree
from amphista_jax.trees.tree import Tree, TreeError

UNTRAINED = ":untrained"  # `<method>:untrained`: the method's freshly initialised heads
# Beside a draft model (or shipped for a fetched pair): `{"settings": {...}, "chosen": "..."}`, the decoding settings
# chosen for it (`model_settings`)
SETTINGS_FILE = "settings.json"


@dataclasses.dataclass(frozen=True)
class DrafterSource:
    """A drafter and where its params come from, read without loading them."""

    method: str  # the registered method (`drafters.DRAFTERS`)
    drafter: Drafter  # with its settings
    path: str | None = None  # the draft-head checkpoint or draft-model directory; None: initialised at load
    note: str | None = None  # what was chosen for the user, and why (e.g. the shipped heads)
    params: Any = None  # params in hand (a `Drafter` passed with its params)
    acceptance: Path | None = None  # the acceptance statistics shipped with the heads (`acceptance`), if any

    @property
    def is_model_dir(self) -> bool:
        """A Hugging Face model directory drafting as a draft model (no `draft.json`)."""
        return self.path is not None and not (Path(self.path) / META_FILE).is_file()


def read_source(source: str | Path | Drafter, model_dir: str | Path | None, config: ModelConfig | None,
                settings: dict[str, Any] | None = None, params: Any = None) -> DrafterSource:
    """The `DrafterSource` of `source`: a `Drafter` (with `params`, or initialised at load); a directory holding
    `draft.json` (trained heads) or `config.json` (a draft model sharing the target's vocabulary, with the acceptance
    statistics and settings beside it, else those shipped for its pair: `paired_dir`, `model_settings`), or a
    fetched model's name (`qwen2.5-coder-0.5b`: a draft model, fetched on first use); a method name (`hydra`,
    `hydra++`): the heads shipped for the target at `model_dir`, else that method's untrained heads (with a note);
    `<method>:untrained`: its untrained heads. `settings` change the drafter's decoding settings (checked by the
    method). Without `model_dir` nothing shipped is looked for; without `config` a draft model's vocabulary is
    checked when it loads. A `GeneratorError` names what is wrong."""
    if isinstance(source, Drafter):
        return DrafterSource(source.name, with_settings(source, settings), params=params)
    from amphista_jax.assets import shipped_heads, shipped_heads_dir, shipped_heads_root
    from amphista_jax.models.fetch import shipped_target
    from amphista_jax.models.hf import load_config

    name = str(source)
    if (fetched := fetched_draft_model(name)) is not None:
        source, name = fetched, str(fetched)
    untrained, method = name.endswith(UNTRAINED), name.removesuffix(UNTRAINED)
    if isinstance(source, Path) or (method not in VARIANTS and Path(name).is_dir()):  # a method name wins over ./name
        path = Path(name)
        if (path / META_FILE).is_file():
            meta = read_draft_meta(path)
            return DrafterSource(meta.method, with_settings(meta.drafter, settings), str(path),
                                 acceptance=acceptance_file(path))
        if (path / "config.json").is_file():
            draft_config = load_config(path)
            if config is not None:
                check_vocabularies(draft_config, config, name)
            paired = paired_dir(path, model_dir)
            try:
                drafter = with_settings(DraftModel(draft_config), model_settings(path, paired))
            except GeneratorError as e:
                raise GeneratorError(f"{name}: {e} (its {SETTINGS_FILE} holds settings chosen for another model: "
                                     "choose again with `amphista-jax calibrate --draft-vocab N --replace`)") from None
            return DrafterSource(DraftModel.name, with_settings(drafter, settings), str(path),
                                 acceptance=acceptance_file(path) or (acceptance_file(paired) if paired else None))
        raise GeneratorError(f"{name} is not a draft-head checkpoint (no {META_FILE}) nor a model (no config.json): "
                             "pass the heads/ directory `amphista-jax train` wrote or a Hugging Face model directory")
    target, shipped = shipped_target(model_dir) if model_dir else None, method.replace("++", "-plus")
    if not untrained and target and shipped in shipped_heads(target):
        path = shipped_heads_dir(shipped, target)
        meta = read_draft_meta(path)
        return DrafterSource(meta.method, with_settings(meta.drafter, settings), str(path),
                             f"using the {name} heads shipped for {target}", acceptance=acceptance_file(path))
    if method not in VARIANTS:
        if untrained:
            raise GeneratorError(f"unknown method {method!r}; registered: {', '.join(VARIANTS)}")
        raise GeneratorError(f"heads {name!r} is neither a draft-head directory nor a method ({', '.join(VARIANTS)}; "
                             f"`<method>{UNTRAINED}` for its untrained heads) nor a model directory")
    drafter = VARIANTS[method]
    note, stats = None, None
    if not drafter.trainable and target:  # a method with nothing to train: its statistics on this target
        stats = acceptance_file(shipped_heads_root(target) / method)
    if drafter.trainable and not untrained:
        note = (f"no trained heads for this model: using untrained {method} heads (expect tau ~1)"
                if method != DraftModel.name else "no trained draft model for this model: drafting with its first "
                f"{drafter.layers} layers, untrained")
    return DrafterSource(drafter.name, with_settings(drafter, settings), note=note, acceptance=stats)


def fetched_draft_model(name: str) -> Path | None:
    """The directory of the fetched model `name` names (fetched on first use), unless a path of that name exists;
    else None."""
    from amphista_jax.models.fetch import MODELS, resolve_model

    return Path(resolve_model(name)) if name in MODELS and not Path(name).exists() else None


def paired_dir(draft_dir: str | Path, model_dir: str | Path | None) -> Path | None:
    """What is shipped for a fetched target's paired draft model (`assets/<target>-heads/draft_model/`: its
    acceptance statistics and settings), where `draft_dir` is that pair's draft model as fetched; else None."""
    from amphista_jax.assets import shipped_heads_root
    from amphista_jax.models.fetch import fetched_as, paired_draft_model

    target = fetched_as(model_dir) if model_dir else None
    if target is None or paired_draft_model(model_dir) != fetched_as(draft_dir):
        return None
    return shipped_heads_root(target) / DraftModel.name


def model_settings(draft_dir: str | Path, paired: Path | None) -> dict[str, Any]:
    """The decoding settings chosen for a draft model (`SETTINGS_FILE`, e.g. its draft vocabulary from
    `amphista-jax calibrate --draft-vocab`): those beside it, else those shipped for its pair (`paired`), else {}."""
    for folder in (Path(draft_dir), paired):
        if folder is not None and (path := folder / SETTINGS_FILE).is_file():
            try:
                kept = json.loads(path.read_text())["settings"]
                if not isinstance(kept, dict):
                    raise TypeError("`settings` is not an object of the draft model's settings")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise GeneratorError(f"{path} is not a draft model's settings file ({type(e).__name__}: {e}): "
                                     "write it again with `amphista-jax calibrate --draft-vocab N --replace`, "
                                     "or delete it") from None
            return kept
    return {}


def write_model_settings(path: str | Path, settings: dict[str, Any], chosen: str) -> Path:
    """Write a draft model's settings file (`SETTINGS_FILE`, read by `model_settings`) whole, with `chosen`: how
    they were chosen, in words."""
    return write_atomic(path, json.dumps({"settings": settings, "chosen": chosen}) + "\n")


def with_settings(drafter: Drafter, settings: dict[str, Any] | None) -> Drafter:
    """`drafter` with `settings` changed, each checked by the method's `from_settings` (a `GeneratorError`)."""
    if not settings:
        return drafter
    try:
        return type(drafter).from_settings({f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)}
                                           | settings)
    except (TypeError, ValueError) as e:
        raise GeneratorError(str(e)) from None


def choose_tree(tree: str | Tree | TreePlan, source: DrafterSource, vocab_size: int | None) -> TreePlan:
    """The plan of the trees `source`'s drafter drafts for `tree`: a `Tree` as it is; a name, a JSON file or `fan-KxD`
    as named; `auto`: chosen on this machine from the acceptance statistics shipped with the heads (once the target
    has loaded and can time steps: `TreePlan.priced`), else the drafter's paper tree (said in the note; a draft
    model's directory quietly); a policy file (`<stem>.batch.json`): its tree per batch size. Every tree named is
    checked against the drafter and the vocabulary (`auto`'s candidates as `usable_acceptance` keeps them)."""
    drafter = source.drafter
    if isinstance(tree, TreePlan):
        plan = tree
    elif not isinstance(tree, str):
        plan = TreePlan(str(tree), tree)
    elif tree == AUTO and (stats := usable_acceptance(source, vocab_size)) is not None:
        plan = TreePlan(tree, acceptance=stats)
    elif (policy := read_policy(tree)) is not None:
        trees = [t for _, t in policy.by_batch if t is not None]
        first = policy.at(1) or (trees[0] if trees else get_tree(drafter.paper_tree))
        plan = TreePlan(tree, first, policy, note=f"tree {tree}: {policy.describe()}")
    else:
        spec, note = resolve_tree(tree, source.path, drafter.paper_tree)
        plan = TreePlan(tree, spec, note=None if source.is_model_dir else note)
    for t in plan.named_trees():
        drafter.check_tree(t, vocab_size)
    return plan


def usable_acceptance(source: DrafterSource, vocab_size: int | None) -> Acceptance | None:
    """`source`'s acceptance statistics with the candidates its drafter (as its settings leave it) can draft; None
    where it has none or can draft none of them (`auto` then falls back to the paper's tree). Statistics of another
    method are refused in one line."""
    if source.acceptance is None:
        return None
    stats = Acceptance.read(source.acceptance)
    if stats.method != source.method:
        raise AcceptanceError(f"{source.acceptance} holds {stats.method} statistics, not {source.method}'s: measure "
                              "them again (`amphista-jax calibrate --acceptance --replace`)")
    fits = []
    for c in stats.candidates:
        try:
            source.drafter.check_tree(c.tree, vocab_size)
            fits.append(c)
        except TreeError:
            continue
    return dataclasses.replace(stats, candidates=tuple(fits)) if fits else None


def load_draft_params(source: DrafterSource, target: Target, model_dir: str | Path, dtype: str, seed: int = 0
                      ) -> tuple[Drafter, Any]:
    """(drafter, params) of `source` for the loaded `target`: params in hand as they are; a checkpoint's restored
    and checked against the target (settings that change the params' shapes refused); a draft model's read in
    `dtype` and kept as its settings say (`DraftModel.kept_params`); otherwise initialised from the target with
    `seed`."""
    if source.params is not None:
        return source.drafter, source.params
    if source.path is None:
        return source.drafter, jax.jit(source.drafter.init)(jax.random.key(seed), target)  # one compile beats eager
    if source.is_model_dir:
        drafter, params = DraftModel.from_pretrained(source.path, target.config, model_dir, dtype)
        drafter = on_settings_of(source, drafter)
        return drafter, drafter.kept_params(params)  # int8 weights made once, at load
    _, _, params = load_draft(source.path, target.config, target.params)
    if not params_fit(source.drafter, params, target):
        raise GeneratorError(f"the settings given change the parameters of the heads in {source.path}: change only "
                             "decoding settings")
    return source.drafter, params


def draft_model_key(source: DrafterSource, dtype: str) -> tuple[str, str, str] | None:
    """What a draft model's params as decoding keeps them depend on: its directory, the dtype it is read in and its
    `weights` (`DraftModel.kept_params`); not its other settings (`p_min`, `temperature`, `draft_vocab`, cut once per
    generation) nor its trees. Drafters of one draft model on one target share one copy of the params under this key
    (`LoadedTarget.draft_models`). None for other sources (heads, params in hand)."""
    if not source.is_model_dir or source.params is not None or not isinstance(source.drafter, DraftModel):
        return None
    return str(Path(source.path).resolve()), dtype, source.drafter.weights


def on_settings_of(source: DrafterSource, drafter: Drafter) -> Drafter:
    """`drafter` (a draft model as read from `source`'s directory, or as another source of it read it) with
    `source`'s settings."""
    return with_settings(drafter, _settings_of(source.drafter, drafter))


def _settings_of(drafter: Drafter, base: Drafter) -> dict[str, Any]:
    """The settings in which `drafter` differs from `base` (a draft model's decoding settings over its config)."""
    return {f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)
            if f.name != "config" and getattr(drafter, f.name) != getattr(base, f.name)}
