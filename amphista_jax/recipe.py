"""`amphista-jax recipe`: a wall-clock budget on one machine turned into shipped head sets, planned before it starts.

    amphista-jax recipe --config configs/recipe/smollm2-h200.yaml [--set budget_s=540 ...]

One config (`RecipeConfig`) names the target, the data (regenerated answers committed with the project, and how
many more to regenerate), the methods (each a train config and a budget of token slots) and the budget. The recipe
runs in `out_dir`:

1. **Probes** (`probe`): each stage measured briefly on this machine: regeneration by answering its first batch of
   prompts (real work, kept), each method by a few steps of its training in a scratch run (`probes/`), and the
   acceptance statistics by measuring them for the untrained heads on one batch of prompts.
2. **Plan** (`plan_stages`): from the probes, each stage's time; the methods in the config's order while their
   training and shipping fit the budget left, then as many more answers as the rest of it allows. What does not fit
   is said and skipped, never cut mid-run; a budget too small for any method is refused in one line.
3. **Stages**, each written as it finishes (`stages/<stage>.json`): `regenerate` (in-flight batched greedy answers,
   `train.distill`, appended to `data/answers.jsonl`); per method `train:<m>` (`train_heads`, the recipe's answers
   as its data where the method trains on conversations; the target's features and top-k labels computed once and
   kept in memory where they fit, `features_fit`, else on the fly) and `ship:<m>` (the heads re-saved in
   `ship_dtype` in files of at most `max_file_mib` under `heads/<m>`, and their acceptance statistics measured
   on held-out prompts, `acceptance.json` beside them, so `--tree auto` can choose for them).
4. **Report**: `report.{json,md}` after every stage: the machine, the plan against what each stage took, each head
   set's steps, tokens and candidate taus, what was skipped and why.

A rerun resumes: finished stages are kept, an interrupted training resumes from its last checkpoint, regeneration
skips what is answered, and the probes and plan are read back (`plan.json`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from amphista_jax.infra.config_io import read_yaml
from amphista_jax.infra.errors import UserError, check_writable_dir
from amphista_jax.infra.machine import memory_bytes, this_machine
from amphista_jax.infra.output_lock import output_lock, write_atomic

if TYPE_CHECKING:
    from amphista_jax.choice.acceptance import Acceptance
    from amphista_jax.train.config import TrainConfig

MIB = 2**20
ACCEPTANCE_BATCH = 8  # prompts decoded together when acceptance statistics are measured (the probe times one batch)


class RecipeError(UserError, ValueError):
    """A recipe that cannot run as configured."""


@dataclasses.dataclass(frozen=True)
class Regenerate:
    """More answers by the target itself, from `prompts` (a file, or a data set of the registry), if the budget
    allows: at most `count`, `batch_size` rows with in-flight refills."""

    prompts: str = ""
    count: int = 0
    batch_size: int = 64
    max_new_tokens: int = 256
    prompt_len: int = 256


@dataclasses.dataclass(frozen=True)
class MethodRecipe:
    config: str  # the method's train config (YAML, relative to the recipe's file or the working directory)
    tokens: int  # token slots to train on: steps = ceil(tokens / (data.batch_size x data.max_len))
    set: tuple[str, ...] = ()  # overrides of that config, `key=value`


@dataclasses.dataclass(frozen=True)
class RecipeConfig:
    methods: dict[str, MethodRecipe]
    model: str = ""  # the target ("" = each train config's own)
    out_dir: str = "runs/recipe"
    budget_s: float = 540.0
    answers: str = ""  # regenerated answers to start from (ShareGPT JSONL with `answer_ids`, `distill`'s output)
    regenerate: Regenerate = Regenerate()
    ship_dtype: str = "bfloat16"
    acceptance_prompts: int = 32
    acceptance_tokens: int = 64
    probe_steps: int = 3
    max_file_mib: float = 15.0

    def __post_init__(self) -> None:
        if not self.methods:
            raise ValueError("methods is empty: name at least one (method: {config: ..., tokens: ...})")
        if not self.budget_s > 0:
            raise ValueError(f"budget_s={self.budget_s} must be > 0")
        if self.probe_steps < 2:
            raise ValueError(f"probe_steps={self.probe_steps} must be >= 2 (the first step compiles)")
        if bad := [m for m, r in self.methods.items() if r.tokens < 1]:
            raise ValueError(f"methods {bad}: tokens must be >= 1")
        if self.regenerate.count < 0 or self.acceptance_prompts < 1 or self.acceptance_tokens < 2:
            raise ValueError("regenerate.count >= 0, acceptance_prompts >= 1 and acceptance_tokens >= 2")


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str  # `regenerate`, `train:<m>`, `ship:<m>`
    estimate_s: float
    planned: bool
    work: int = 0  # answers to regenerate, steps to train
    why: str = ""  # what it does, or why it is skipped


def train_config(cfg: RecipeConfig, method: str, where: Path, *, steps: int | None = None,
                 out_dir: Path | None = None, answers: Path | None = None, extra: tuple[str, ...] = ()
                 ) -> TrainConfig:
    """`method`'s `TrainConfig` as the recipe runs it: its file with the recipe's target, data (`answers`, where
    it trains on conversations), steps (the token budget's unless given) and out_dir."""
    from amphista_jax.train.config import load_train_config

    r = cfg.methods[method]
    path = config_path(where, r.config)
    base = load_train_config(path, list(r.set))
    steps = steps or math.ceil(r.tokens / (base.data.batch_size * base.data.max_len))
    sets = [f"loop.steps={steps}", f"out_dir={out_dir or Path(cfg.out_dir) / 'train' / method}",
            f"loop.checkpoint_every={max(1, min(base.loop.checkpoint_every, steps))}",
            "loop.eval_every=0", *([f"model={cfg.model}"] if cfg.model else []),
            *([f"data.train={answers}", "data.heldout=''"] if answers and base.data.kind == "sharegpt" else []),
            *extra]
    return load_train_config(path, [*r.set, *sets])


def config_path(where: Path, name: str) -> Path:
    """A method's train config named in a recipe: relative to the recipe's folder `where`, else to the working
    directory."""
    return where / name if (where / name).is_file() else Path(name)


def features_fit(tcfg: TrainConfig, examples: int, capacity: int | None) -> bool:
    """Whether the target's features (the hidden states the method reads, at every position of every example) and
    its top-k labels fit in half of `capacity` bytes (this device's memory; None: unknown, so not kept)."""
    from amphista_jax.models.fetch import resolve_model
    from amphista_jax.models.hf import load_config as target_config

    drafter = tcfg.trained_drafter()
    if capacity is None or drafter.loss_runs_target:
        return False
    config = target_config(resolve_model(tcfg.model))
    per_position = config.hidden_size * (1 + len(drafter.captured_layers(config))) * 4 + tcfg.label_store_top_k * 8
    return examples * tcfg.data.max_len * per_position <= capacity // 2


def count_lines(path: Path) -> int:
    return sum(1 for _ in path.open()) if path.is_file() else 0


# -- probes -------------------------------------------------------------------------------------------------------


def _timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def regenerate(cfg: RecipeConfig, where: Path, answers: Path, more: int) -> int:
    """Up to `more` new answers appended to `answers` (`train.distill`, the prompts after those answered); how many."""
    from amphista_jax.models.fetch import resolve_data
    from amphista_jax.train.distill import distill

    r = cfg.regenerate
    return distill(_model(cfg, where), resolve_data(r.prompts), str(answers), batch_size=r.batch_size,
                   max_new_tokens=r.max_new_tokens, prompt_len=r.prompt_len, limit=count_lines(answers) + more)


def probe(cfg: RecipeConfig, where: Path, answers: Path) -> dict[str, Any]:
    """Each stage measured briefly here (see the module docstring): seconds per answer (its first batch, kept),
    and per method its training's fixed seconds (load, compile, evaluation, saving) and seconds per step, and the
    seconds of one batch of acceptance prompts."""
    from amphista_jax.train.heads import train_heads
    from amphista_jax.train.loop import read_metrics

    out = Path(cfg.out_dir)
    probes: dict[str, Any] = {}
    if cfg.regenerate.count:
        n, seconds = _timed(regenerate, cfg, where, answers, min(cfg.regenerate.count, cfg.regenerate.batch_size))
        probes["regenerate"] = {"answers": n, "seconds": seconds}
    for method in cfg.methods:
        run = out / "probes" / f"train-{method}"
        shutil.rmtree(run, ignore_errors=True)  # the recipe's own scratch run
        tcfg = train_config(cfg, method, where, steps=cfg.probe_steps, out_dir=run, answers=answers,
                            extra=("loop.log_every=1", "eval_batches=1"))
        _, seconds = _timed(train_heads, tcfg)
        rows = [r for r in read_metrics(run) if "tokens_per_s" in r][1:]  # the first step compiles
        tokens = tcfg.data.batch_size * tcfg.data.max_len
        step_s = float(np.median([tokens / r["tokens_per_s"] for r in rows]))
        probes[f"train:{method}"] = {"fixed_s": max(0.0, seconds - cfg.probe_steps * step_s), "step_s": step_s}
        _, ship_s = _timed(_acceptance, cfg, where, run / "heads", min(ACCEPTANCE_BATCH, cfg.acceptance_prompts))
        probes[f"ship:{method}"] = {"batch_s": ship_s}
    return probes


def _model(cfg: RecipeConfig, where: Path) -> str:
    """The recipe's target's directory: `model`'s, else the first method's config's."""
    from amphista_jax.models.fetch import resolve_model

    name = cfg.model or read_yaml(config_path(where, next(iter(cfg.methods.values())).config)).get("model")
    return resolve_model(name or None)


def plan_stages(cfg: RecipeConfig, probes: dict[str, Any], where: Path, spent_s: float) -> list[Stage]:
    """What runs in the budget left after `spent_s` (the probes): methods in the config's order while their
    training and shipping fit, then regeneration with what is left. Refused in one line where no method fits."""
    left = cfg.budget_s - spent_s
    stages, ready = [], []
    for method in cfg.methods:
        p = probes[f"train:{method}"]
        steps = train_config(cfg, method, where).loop.steps
        train_s = p["fixed_s"] + steps * p["step_s"]
        ship_s = probes[f"ship:{method}"]["batch_s"] * math.ceil(cfg.acceptance_prompts / ACCEPTANCE_BATCH)
        fits = train_s + ship_s <= left
        if fits:
            left -= train_s + ship_s
            ready.append(method)
        why = f"{steps} steps" if fits else f"needs {train_s + ship_s:.0f} s with {left:.0f} s left: skipped"
        stages += [Stage(f"train:{method}", train_s, fits, steps, why), Stage(f"ship:{method}", ship_s, fits)]
    if not ready:
        cheapest = min(stages[::2], key=lambda s: s.estimate_s)
        raise RecipeError(f"budget_s={cfg.budget_s:.0f}: no method fits the {cfg.budget_s - spent_s:.0f} s left "
                          f"after the probes; the cheapest, {cheapest.name.split(':')[1]}, needs "
                          f"{cheapest.estimate_s:.0f} s to train and more to ship here: raise budget_s or lower "
                          "its tokens")
    if cfg.regenerate.count:
        r = probes["regenerate"]
        per_answer = r["seconds"] / max(r["answers"], 1)
        more = min(cfg.regenerate.count - r["answers"], int(left / per_answer)) if r["answers"] else 0
        stages.insert(0, Stage("regenerate", more * per_answer, more > 0, max(more, 0), f"{more} more answers"
                               if more > 0 else "no time left for more answers: skipped"))
    return stages


# -- stages -------------------------------------------------------------------------------------------------------


def _acceptance(cfg: RecipeConfig, where: Path, heads: Path, prompts: int) -> Acceptance:
    """`heads`' acceptance statistics on `prompts` held-out prompts (`tree_search.measure_acceptance`)."""
    from amphista_jax.facade.drafter_source import read_source
    from amphista_jax.facade.generator import Generator
    from amphista_jax.tree_search import calibration_prompts, measure_acceptance

    model = _model(cfg, where)
    gen = Generator.load(model, heads, read_source(heads, model, None).drafter.paper_tree)
    ids, what = calibration_prompts(gen, prompts)
    return measure_acceptance(gen, ids, cfg.acceptance_tokens,
                              f"{len(ids)} {what}, {cfg.acceptance_tokens} new tokens, greedy",
                              batch_size=ACCEPTANCE_BATCH)


def ship(cfg: RecipeConfig, where: Path, method: str) -> dict[str, Any]:
    """`train:<method>`'s heads converted to `ship_dtype` under `heads/<method>` (`convert`, staged: a killed
    conversion leaves nothing, a finished one is kept), with their acceptance statistics."""
    from amphista_jax.choice.acceptance import ACCEPTANCE_FILE
    from amphista_jax.convert import convert
    from amphista_jax.drafters.io import META_FILE

    out = Path(cfg.out_dir) / "heads" / method
    if not (out / META_FILE).is_file():
        convert(str(out), _model(cfg, where), heads=str(Path(cfg.out_dir) / "train" / method / "heads"),
                dtype=cfg.ship_dtype)
    stats = _acceptance(cfg, where, out, cfg.acceptance_prompts)
    stats.write(out / ACCEPTANCE_FILE)
    return {"heads": str(out), "candidates": {c.name: round(c.tau, 3) for c in stats.candidates},
            "best_tau": round(stats.best_tau, 3)}


def stage_file(out: Path, stage: str) -> Path:
    """Where a finished stage's result is kept."""
    return out / "stages" / f"{stage.replace(':', '-')}.json"


def oversized(out: Path, limit_mib: float) -> list[str]:
    """The files under `out`'s heads and data larger than `limit_mib`."""
    return sorted(f"{p.relative_to(out)} ({p.stat().st_size / MIB:.1f} MiB)" for d in ("heads", "data")
                  for p in (out / d).rglob("*") if p.is_file() and p.stat().st_size > limit_mib * MIB)


def run_recipe(cfg: RecipeConfig, config_path: str | Path) -> dict[str, Any]:
    """The recipe (module docstring) in `cfg.out_dir`, resuming what it holds."""
    from amphista_jax.engine.memory_plan import accelerator_capacity
    from amphista_jax.train.heads import train_heads

    where, out = Path(config_path).parent, Path(cfg.out_dir)
    for method in cfg.methods:  # every method's config is checked before anything runs
        train_config(cfg, method, where)
    if cfg.answers and not Path(cfg.answers).is_file():
        raise RecipeError(f"answers {cfg.answers} does not exist: name distill's output, or leave it empty")
    if cfg.regenerate.count and not cfg.regenerate.prompts:
        raise RecipeError("regenerate.count > 0 needs regenerate.prompts (a file or a data set, e.g. sharegpt)")
    check_writable_dir(out, "out_dir")
    t0 = time.perf_counter()
    with output_lock(out, "recipe"):
        answers = out / "data" / "answers.jsonl"
        if not answers.exists():
            answers.parent.mkdir(parents=True, exist_ok=True)
            if cfg.answers:
                shutil.copyfile(cfg.answers, answers)
            else:
                answers.touch()
        saved = json.loads((out / "plan.json").read_text()) if (out / "plan.json").is_file() else None
        if saved is None:
            probes, spent = _timed(probe, cfg, where, answers)
            stages = plan_stages(cfg, probes, where, spent)
            saved = {"probes": probes, "probe_s": spent, "stages": [dataclasses.asdict(s) for s in stages]}
            write_atomic(out / "plan.json", json.dumps(saved, indent=1) + "\n")
        stages = [Stage(**s) for s in saved["stages"]]
        print(plan_table(cfg, stages, saved["probe_s"]), file=sys.stderr)
        capacity = accelerator_capacity(None)[0] or memory_bytes()
        for stage in stages:
            marker = stage_file(out, stage.name)
            if not stage.planned or marker.is_file():
                continue
            kind, _, method = stage.name.partition(":")
            t1 = time.perf_counter()
            if kind == "regenerate":
                n = regenerate(cfg, where, answers, stage.work)
                result: dict[str, Any] = {"answered": n, "answers": count_lines(answers)}
            elif kind == "train":
                tcfg = train_config(cfg, method, where, answers=answers)
                keep = tcfg.data.cache_target_hidden
                if tcfg.data.kind == "sharegpt":  # the recipe's answers: their features kept where they fit
                    keep = features_fit(tcfg, count_lines(answers), capacity)
                    tcfg = dataclasses.replace(tcfg, data=dataclasses.replace(
                        tcfg.data, cache_target_hidden=keep, hidden_store=""))
                summary = train_heads(tcfg)
                result = {"steps": summary["steps"], "tokens": summary["tokens_seen"], "features_in_memory": keep,
                          "heldout_after": summary["heldout_after"]}
            else:
                result = ship(cfg, where, method)
            marker.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(marker, json.dumps(result | {"seconds": time.perf_counter() - t1}, indent=1) + "\n")
            write_report(cfg, out, stages, saved, time.perf_counter() - t0)
        return write_report(cfg, out, stages, saved, time.perf_counter() - t0)


def plan_table(cfg: RecipeConfig, stages: list[Stage], probe_s: float) -> str:
    rows = [f"recipe plan: budget {cfg.budget_s:.0f} s, probes took {probe_s:.0f} s",
            "| stage | planned | estimate s | note |", "|---|---|---|---|"]
    rows += [f"| {s.name} | {'yes' if s.planned else 'no'} | {s.estimate_s:.0f} | {s.why} |" for s in stages]
    return "\n".join(rows)


def write_report(cfg: RecipeConfig, out: Path, stages: list[Stage], saved: dict[str, Any], elapsed: float
                 ) -> dict[str, Any]:
    """`report.{json,md}`: the plan against what each finished stage took and made."""
    done = {s.name: json.loads(p.read_text()) for s in stages if (p := stage_file(out, s.name)).is_file()}
    too_big = oversized(out, cfg.max_file_mib)
    report = {"out_dir": str(out), "machine": dataclasses.asdict(this_machine()), "budget_s": cfg.budget_s,
              "probe_s": saved["probe_s"],
              "this_run_s": elapsed, "stages": [dataclasses.asdict(s) | {"result": done.get(s.name)} for s in stages],
              "files_over_limit": too_big}
    lines = [f"# Recipe: {out}", "", f"Machine: {this_machine().describe()}", "",
             f"Budget {cfg.budget_s:.0f} s; probes {saved['probe_s']:.0f} s; this run {elapsed:.0f} s.", "",
             "| stage | planned | estimate s | took s | result |", "|---|---|---|---|---|"]
    for s in stages:
        r = done.get(s.name)
        what = "-" if r is None else ", ".join(f"{k} {v}" for k, v in r.items() if k in (
            "answered", "answers", "steps", "tokens", "features_in_memory", "best_tau"))
        took = "-" if r is None else f"{r['seconds']:.0f}"
        lines.append(f"| {s.name} | {'yes' if s.planned else 'no: ' + s.why} | {s.estimate_s:.0f} | {took} | {what} |")
    lines += ["", f"Files over {cfg.max_file_mib:g} MiB: {', '.join(too_big) or 'none'}."]
    write_atomic(out / "report.json", json.dumps(report, indent=1) + "\n")
    write_atomic(out / "report.md", "\n".join(lines) + "\n")
    return report
