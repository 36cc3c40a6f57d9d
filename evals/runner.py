"""The evaluation runner: `amphista-jax eval --config configs/eval/humaneval-code.yaml [--methods ...]`.

For each method (the AR baseline first, then each drafter with its heads and tree) every prompt is
generated with identical settings (sampling, max_new_tokens, batch size, dtype, seed per prompt). Prompts
are right-padded to a multiple of `pad_multiple` tokens so that one compiled program serves many prompts;
each new shape is compiled ahead of time (timed apart as `compile_s`) and run once untimed (warm-up) before
the timed runs. With `mesh: {data, fsdp, tensor}` the target and each method's heads are sharded over a mesh of
the devices (`sharding.place_for_decoding`) and every program runs under `sharding.on_mesh`; the tokens are one
device's. One JSON line per finished prompt goes to `results/<label>.process<i>.jsonl`
(`amphista_jax.evals.results`); a rerun says so and skips finished prompts (`--replace` starts over). Several
processes (`jax.distributed`, see `amphista_jax.evals.launch_local`) split the unfinished prompts; they share
`out_dir` on one filesystem, and process 0 merges every file into `summary.json`, `report.md` and the plots
(`amphista_jax.evals.report`). With both, each process decodes its own prompts on a mesh of its own (local)
devices: the mesh's sizes multiply to `jax.local_device_count()`.

Every input is checked before the target is loaded: the config, the dataset, each method spec and, when
resuming, that `run.json` records the same settings and the same content (sha256) of the target, the heads
and the dataset (`amphista_jax.infra.identity`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from tqdm import tqdm

from amphista_jax.engine.decode import pad_prompts
from amphista_jax.engine.decode_spec import check_decode_settings
from amphista_jax.engine.sharding import MeshError, make_mesh
from amphista_jax.evals.datasets import DatasetConfig, Prompt, dataset_file, load_prompts, render_turn
from amphista_jax.evals.head_accuracy import head_accuracy, heldout_batches
from amphista_jax.evals.methods import CHOSEN, Method, resolve_methods
from amphista_jax.evals.metrics import breakdown, lossless_mismatches, tree_statistics
from amphista_jax.evals.report import write_reports
from amphista_jax.evals.results import ResultWriter, process_file, read_results, safe_label
from amphista_jax.facade.generator import Generator
from amphista_jax.infra.compiled_programs import release_if_crowded
from amphista_jax.infra.errors import OutputExistsError, UserError, check_writable_dir
from amphista_jax.infra.identity import RunMismatchError, changes, sha256_file, target_identity
from amphista_jax.infra.machine import this_machine
from amphista_jax.infra.output_lock import LOCK_FILE, output_lock, write_atomic
from amphista_jax.models.attention import AttentionBackend
from amphista_jax.models.fetch import default_model, resolve_model
from amphista_jax.models.hf import DTYPES, load_config
from amphista_jax.models.target import Target
from amphista_jax.train.config import DataConfig, MeshConfig
from amphista_jax.train.loop import maybe_initialize_distributed
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.verify import AcceptanceConfig


class EvalConfigError(UserError, ValueError):
    """An eval config that cannot work with its model: found before any weights load."""


ORDERS = ("method", "prompt")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    dataset: DatasetConfig = DatasetConfig()
    methods: tuple[str, ...] = ("ar",)  # specs, see amphista_jax.evals.methods; the AR baseline is always run first
    out_dir: str = "runs/eval/default"
    model: str = ""  # HF checkpoint directory, a fetched name (smollm2) or tiny; "" = `fetch.default_model()`
    tree: str = "mc_sim_7b_63"  # default tree of every draft method (a spec's `@tree` overrides it)
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    acceptance: str | None = None  # None: greedy at temperature 0, lossless rejection sampling otherwise
    batch_size: int = 1
    dtype: str = "float32"
    seed: int = 0
    pad_multiple: int = 64
    attention: str = "xla"
    heldout: DataConfig = DataConfig(kind="stdlib")  # per-head accuracy data
    heldout_batches: int = 4  # 0 = skip per-head accuracy
    allow_mismatch: bool = False  # exit 0 even when a method's greedy output differs from AR's
    mesh: MeshConfig | None = None  # None = one device; sizes multiply to each process's device count
    # method: each method through every prompt in turn; prompt: every method on a batch before the next batch (the
    # ratios of a run then hold when the machine's speed drifts during it)
    order: str = "method"

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.pad_multiple < 1:
            raise ValueError(f"batch_size={self.batch_size} and pad_multiple={self.pad_multiple} must both be >= 1")
        if not self.methods:
            raise ValueError("methods is empty: give at least `ar`")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} must be one of {', '.join(DTYPES)}")
        AttentionBackend.parse(self.attention)
        if self.order not in ORDERS:
            raise ValueError(f"order {self.order!r} must be one of {', '.join(ORDERS)}")
        if self.heldout_batches < 0:
            raise ValueError(f"heldout_batches={self.heldout_batches} must be >= 0 (0 = skip per-head accuracy)")
        check_decode_settings(self.max_new_tokens, SamplingConfig(self.temperature, self.top_k, self.top_p),
                              AcceptanceConfig(self.acceptance))

    @property
    def lossless_checked(self) -> bool:
        return self.temperature == 0.0


# Settings that change what a prompt's result is; a rerun into the same out_dir must keep them.
# `heldout` / `heldout_batches` are here because head_accuracy.json is cached per method label.
RESULT_SETTINGS = ("model", "max_new_tokens", "temperature", "top_k", "top_p", "acceptance", "batch_size", "dtype",
                   "seed", "pad_multiple", "attention", "heldout", "heldout_batches")


# What an eval run writes into its out_dir: what `--replace` removes (nothing else there is touched; run.json,
# the mark of an eval run, last).
EVAL_OUTPUTS = ("results", "compile", "merged", "head_accuracy.json", "tree_stats.json", "summary.json", "report.md",
                "head_accuracy.png", "tau_by_category.png", "run.json")


def check_run_file(out_dir: Path, cfg: EvalConfig, model_dir: str, methods: list[Method],
                   dataset_path: Path | None = None, replace: bool = False) -> dict[str, Any]:
    """Compare with `run.json` of earlier runs into `out_dir` (resuming must not mix settings, nor results of
    a target, heads or dataset that changed under the same path; `replace` starts over instead); returns what
    `write_run_file` records."""
    path = out_dir / "run.json"
    dataset = {"kind": cfg.dataset.kind, "path": cfg.dataset.path, "chat": cfg.dataset.use_chat}
    if cfg.dataset.turns:  # what a prompt's record holds (recorded when set, so earlier runs of all turns resume)
        dataset["turns"] = cfg.dataset.turns
    if dataset_path is not None:
        dataset["sha256"] = sha256_file(dataset_path)
    values = {k: getattr(cfg, k) for k in RESULT_SETTINGS}
    settings = json.loads(json.dumps(  # as stored (tuples -> lists)
        {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in values.items()} | {
            "model": model_dir, "model_files": target_identity(model_dir), "dataset": dataset}))
    described = json.loads(json.dumps({m.label: m.describe() for m in methods}))  # as stored (tuples -> lists)
    if not path.is_file() and out_dir.is_dir() and any(p.name != LOCK_FILE for p in out_dir.iterdir()):
        raise OutputExistsError(f"out_dir {out_dir} holds files but no run.json, so it is not an eval run: pick a "
                                "new out_dir (eval writes report.md, summary.json, results/ ... into it)")
    try:
        previous = json.loads(path.read_text()) if path.is_file() else {"settings": settings, "methods": {}}
    except json.JSONDecodeError as e:
        raise RunMismatchError(f"{path} is not valid JSON (line {e.lineno}: {e.msg}): restore it, or use a new "
                               "out_dir") from None
    if not isinstance(previous, dict) or not isinstance(previous.get("settings"), dict):  # e.g. a train run's
        raise RunMismatchError(f"{path} is not an eval run record: restore it, or use a new out_dir")
    if replace:  # an eval run's directory: its results are discarded (`discard_run`)
        return {"settings": settings, "methods": described}
    changed = changes(previous.get("settings"), settings)
    for label, now in described.items():
        if label in previous.get("methods", {}):
            before = previous["methods"][label]
            if "tree" not in now:  # `auto` not chosen yet: its tree is compared once it is (`_evaluate`)
                before = {k: v for k, v in before.items() if k not in CHOSEN}
            changed |= changes(before, now, f"method {label}")
    if changed:
        raise RunMismatchError(f"{out_dir} holds results made with other settings or inputs (before, now): "
                               f"{_format_changes(changed)}; use a new out_dir, or pass --replace to discard those "
                               "results and evaluate with these")
    return {"settings": settings, "methods": previous.get("methods", {}) | described}


def _format_changes(changed: dict[str, tuple[Any, Any]], limit: int = 4) -> str:
    """`key: (before, now)` items with long values cut; the files of one checkpoint (`model_files`, a
    method's `heads_files`) as one item naming the first file that differs."""
    def short(v: Any) -> str:
        text = repr(v[:12] + "..." if isinstance(v, str) and len(v) == 64 else v)  # a sha256
        return text if len(text) <= 60 else text[:57] + "..."

    items, files = [], {}
    for k, (before, now) in changed.items():
        group = next((k[: k.index(g) + len(g)] for g in ("model_files.", "heads_files.") if g in k), None)
        if group:
            files.setdefault(group.rstrip(".").replace(".heads_files", " heads_files"), []).append(
                k.removeprefix(group))
        else:
            items.append(f"{k}: ({short(before)}, {short(now)})")
    items = [f"{g}: content changed ({len(n)} file(s) differ, e.g. {n[0]})" for g, n in files.items()] + items
    return "; ".join(items[:limit]) + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def write_run_file(out_dir: Path, run: dict[str, Any]) -> None:
    """Process 0 records this run's settings and methods (after every process checked the old ones)."""
    _barrier("eval-run-file")
    if jax.process_index() == 0:
        write_atomic(out_dir / "run.json", json.dumps(run, indent=2) + "\n")


def _agree_on_trees(gens: dict[str, Generator], batch: int) -> None:
    """Under several processes, every process decodes on the tree process 0's calibration chose for each `auto`
    method (each machine calibrates on its own; timing noise must not split one method between two trees)."""
    if jax.process_count() == 1:
        return
    local = [g.policy for _, g in sorted(gens.items()) if g.policy is not None and g.policy.chooses_here]
    picks = np.array([-1 if (i := p.decision(batch).index) is None else i for p in local], np.int32)
    for policy, pick in zip(local, multihost_utils.broadcast_one_to_all(picks), strict=True):
        policy.decisions[batch] = dataclasses.replace(policy.decision(batch), index=None if pick < 0 else int(pick))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


@dataclasses.dataclass
class _Session:
    cfg: EvalConfig
    base: Generator  # the AR generator of the target
    gens: dict[str, Generator]  # each method's by label, sharing the base's weights (`Method.generator`)
    results_dir: Path

    @property
    def params(self) -> dict:
        return self.base.params

    @property
    def tok(self) -> Any:
        return self.base.tokenizer

    def on_mesh(self) -> contextlib.AbstractContextManager:
        """Where programs are traced and run: `on_mesh(mesh)`, or nothing special without a mesh."""
        return self.base.on_mesh()


def eval_mesh(mesh: MeshConfig | None) -> Mesh | None:
    """A mesh of this process's devices (each process of a multi-process run decodes its own prompts), or None;
    a one-line error naming the fix when the sizes do not multiply to their count."""
    if mesh is None:
        return None
    try:
        return make_mesh(mesh.data, mesh.fsdp, mesh.tensor, devices=jax.local_devices())
    except MeshError as e:
        per_process = f" (each of the {jax.process_count()} processes meshes its own devices)" * (
            jax.process_count() > 1)
        raise MeshError(f"{e}{per_process}, or set mesh=null for one device") from None


def _run_batch(s: _Session, gen: Generator, batch: list[tuple[int, Prompt]], compile_log: ResultWriter
               ) -> list[dict[str, Any]]:
    """Generate every turn of `batch` (global index, prompt) with `gen`; returns one record per prompt."""
    cfg = s.cfg
    # the drafter as the method spec resolved it for this run's temperature (`#temperature=` included)
    spec = gen.spec(cfg.max_new_tokens, SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p),
                    AcceptanceConfig(cfg.acceptance), adapt=False)
    chat = cfg.dataset.use_chat
    turns: dict[int, list[dict[str, Any]]] = {i: [] for i, _ in batch}
    node_stats: dict[int, list[np.ndarray]] = {}
    for t in range(max(len(p.turns) for _, p in batch)):
        rows = [(i, p) for i, p in batch if len(p.turns) > t]
        ids = [render_turn(s.tok, p, [x["text"] for x in turns[i]], chat) for i, p in rows]
        ids += [ids[0]] * (cfg.batch_size - len(ids))  # fixed batch shape; padding rows are discarded
        tokens, lengths = pad_prompts(ids, pad_id=gen.pad_id, multiple=cfg.pad_multiple)
        rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.seed), rows[0][0]), t)
        out, seconds, compile_s = gen.run(tokens, lengths, spec, rng)
        if compile_s:  # the first run of a new program warms it up: not timed
            compile_log.write({"process": jax.process_index(), "shape": list(tokens.shape), "compile_s": compile_s})
            out, seconds, _ = gen.run(tokens, lengths, spec, rng)
        steps = out.row_steps
        for row, (i, _) in enumerate(rows):
            n = int(out.num_tokens[row])
            new = [int(x) for x in out.tokens[row, :n]]
            accept = [int(a) for a in out.accept_lengths[row] if a > 0]
            turns[i].append({"prompt_tokens": int(lengths[row]), "tokens": new,
                             "text": s.tok.decode(new, skip_special_tokens=True), "new_tokens": n,
                             "steps": int(steps[row]), "accept_lengths": accept,
                             "drafted": int(out.drafted[row].sum()),
                             "wall_s": seconds / len(rows)})
            if out.node_tries is not None:
                node_stats.setdefault(i, []).append(np.stack([out.node_tries[row], out.node_hits[row]]))
    records = []
    for i, p in batch:
        record = {"id": p.id, "category": p.category, "index": i, "turns": turns[i]}
        if i in node_stats:
            total = np.sum(node_stats[i], axis=0)  # [2, D, R]
            record |= {"node_tries": total[0].tolist(), "node_hits": total[1].tolist()}
        records.append(record)
    return records


@dataclasses.dataclass
class _MethodRun:
    """What is left of one method on this process: its unfinished prompts in batches, and where they go."""

    method: Method
    done_before: int
    batches: list[list[tuple[int, Prompt]]]  # (global index, prompt), batch_size each but the last
    gen: Generator
    writer: ResultWriter
    compile_log: ResultWriter

    def run_batch(self, s: _Session, k: int, bar: tqdm) -> None:
        for record in _run_batch(s, self.gen, self.batches[k], self.compile_log):
            self.writer.write(record)
            bar.update(1)

    def close(self) -> None:
        self.writer.close()
        self.compile_log.close()


def _method_run(s: _Session, method: Method, prompts: list[Prompt]) -> _MethodRun:
    """This process's share of `method`'s unfinished prompts."""
    finished = {r["id"] for r in read_results(s.results_dir, method.label)}
    _barrier(f"eval-read-{safe_label(method.label)}")  # every process read the same finished set
    todo = [(i, p) for i, p in enumerate(prompts) if p.id not in finished]
    mine = todo[jax.process_index()::jax.process_count()]
    bs = s.cfg.batch_size
    dirs = (s.results_dir, s.results_dir.parent / "compile")  # results, then compile times
    files = [process_file(d, method.label, jax.process_index()) for d in dirs]
    return _MethodRun(method, len(finished), [mine[k: k + bs] for k in range(0, len(mine), bs)],
                      s.gens[method.label], *map(ResultWriter, files))


def run_methods(s: _Session, methods: list[Method], prompts: list[Prompt]) -> None:
    """Generate this process's share of every method's unfinished prompts, in `s.cfg.order`: `method`, each method
    through all its prompts in turn; `prompt`, every method on one batch of prompts before the next batch, so a
    machine that speeds up or slows down during the run shifts every method's timings alike."""
    runs = [_method_run(s, m, prompts) for m in methods]
    if s.cfg.order == "method":
        schedule = [(r, k) for r in runs for k in range(len(r.batches))]
    else:
        schedule = [(r, k) for k in range(max(len(r.batches) for r in runs)) for r in runs if k < len(r.batches)]
    done = sum(r.done_before for r in runs)
    with tqdm(total=sum(len(r.batches[k]) for r, k in schedule), unit="prompt", dynamic_ncols=True,
              desc=f"{len(runs)} methods, by {s.cfg.order} ({done} done before)",
              disable=jax.process_index() != 0) as bar:
        for r, k in schedule:
            bar.set_postfix_str(r.method.label)
            r.run_batch(s, k, bar)
            # every method's programs over a dozen length buckets: past the memory-mapping limit otherwise
            release_if_crowded(*(run.gen.release_programs for run in runs))
    for r in runs:
        r.close()


def _head_accuracies(s: _Session, methods: list[Method], config: Any, out_dir: Path) -> dict[str, Any]:
    """Per-head held-out accuracy of every draft method with heads (not of one with nothing to train), cached in
    head_accuracy.json across reruns."""
    path = out_dir / "head_accuracy.json"
    cache = json.loads(path.read_text()) if path.is_file() else {}
    drafts = [m for m in methods if m.drafter is not None and m.drafter.trainable and m.label not in cache]
    if drafts and s.cfg.heldout_batches > 0:
        batches = heldout_batches(s.tok, s.cfg.heldout, s.cfg.heldout_batches)
        for m in drafts:
            with s.on_mesh():
                gen = s.gens[m.label]
                acc = head_accuracy(Target(config, s.params), gen.drafter, gen.draft_params, batches)
            cache[m.label] = {str(k): v for k, v in acc.items()}
        write_atomic(path, json.dumps(cache, indent=2) + "\n")
    return {m.label: cache[m.label] for m in methods if m.label in cache}


def summarize(s: _Session, methods: list[Method], prompts: list[Prompt], config: Any, out_dir: Path,
              model_dir: str) -> dict[str, Any]:
    """Merge every process's results (process 0) and write summary.json, report.md and the plots."""
    order = {p.id: k for k, p in enumerate(prompts)}
    results = {m.label: sorted((r for r in read_results(s.results_dir, m.label) if r["id"] in order),
                               key=lambda r: order[r["id"]]) for m in methods}
    merged = out_dir / "merged"
    merged.mkdir(exist_ok=True)
    for label, recs in results.items():
        write_atomic((merged / f"{safe_label(label)}.jsonl"), "".join(json.dumps(r) + "\n" for r in recs))
    ar = methods[0].label
    compile_s = {m.label: [json.loads(x) for x in _read_lines(s.results_dir.parent / "compile", m.label)]
                 for m in methods}
    summary = {
        "model": model_dir, "config": dataclasses.asdict(s.cfg), "backend": jax.default_backend(),
        "machine": this_machine().describe(),
        "processes": jax.process_count(), "prompts": len(prompts),
        "methods": [m.describe() for m in methods],
        "metrics": breakdown(results, ar),
        "lossless": ({"checked": True, "mismatches": lossless_mismatches(results, ar)} if s.cfg.lossless_checked
                     else {"checked": False, "reason": "temperature > 0: outputs are samples"}),
        "head_accuracy": _head_accuracies(s, methods, config, out_dir),
        "compile": compile_s,
    }
    stats = {m.label: tree_statistics(results[m.label]) for m in methods if m.drafter is not None}
    stats = {k: v | {"tree": next(m.tree_name for m in methods if m.label == k)} for k, v in stats.items() if v}
    write_atomic(out_dir / "tree_stats.json", json.dumps(stats, indent=2) + "\n")
    write_reports(out_dir, summary)
    return summary


def _read_lines(directory: Path, label: str) -> list[str]:
    return [line for p in sorted(directory.glob(f"{safe_label(label)}.process*.jsonl"))
            for line in p.read_text().splitlines() if line.strip()]


def discard_run(out_dir: Path) -> None:
    """Remove an earlier eval run's outputs (`EVAL_OUTPUTS`) from `out_dir`; other files there stay."""
    for name in EVAL_OUTPUTS:
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def _resume_note(out_dir: Path) -> str | None:
    """The line that says an earlier run into `out_dir` is resumed (None: nothing to resume)."""
    if not (out_dir / "run.json").is_file():
        return None
    done = sum(1 for p in (out_dir / "results").glob("*.jsonl") for line in p.read_text().splitlines() if line)
    state = "finished" if (out_dir / "summary.json").is_file() else "did not finish (killed?)"
    return (f"note: {out_dir} holds an eval run with these settings that {state}: resuming it ({done} prompt "
            "result(s) kept, only the missing ones run); pass --replace to start over")


def run_eval(cfg: EvalConfig, replace: bool = False) -> dict[str, Any] | None:
    """Run every method on every prompt (resuming; `replace`: discarding an earlier run in `out_dir` instead),
    then merge on process 0. Returns the summary on process 0 and None elsewhere."""
    maybe_initialize_distributed()
    model_dir = resolve_model(cfg.model or default_model())
    out_dir = Path(cfg.out_dir)
    # Bad input is found here, before any model is loaded.
    config = load_config(model_dir)
    check_decode_settings(cfg.max_new_tokens, SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p),
                          AcceptanceConfig(cfg.acceptance), config.vocab_size)
    mesh = eval_mesh(cfg.mesh)
    check_writable_dir(out_dir, "out_dir")
    prompts, report = load_prompts(cfg.dataset)
    methods = resolve_methods(cfg.methods, cfg.tree, config, model_dir, cfg.temperature, cfg.batch_size)
    check_run_file(out_dir, cfg, model_dir, methods, dataset_file(cfg.dataset), replace)
    if jax.process_index() == 0:
        print(report.summary())
    with output_lock(out_dir, "eval") if jax.process_index() == 0 else contextlib.nullcontext():
        return _evaluate(cfg, model_dir, out_dir, mesh, prompts, methods, replace)


def _evaluate(cfg: EvalConfig, model_dir: str, out_dir: Path, mesh: Mesh | None, prompts: list[Prompt],
              methods: list[Method], replace: bool) -> dict[str, Any] | None:
    """`run_eval` under the output directory's lock."""
    check_run_file(out_dir, cfg, model_dir, methods, dataset_file(cfg.dataset), replace)  # again, under the lock
    # On a mesh each device reads only its slices of the target (no whole copy on the host).
    base = Generator.load(model_dir, dtype=cfg.dtype, mesh=mesh, attention=cfg.attention)
    attached = {m.label: m.generator(base, cfg.seed) for m in methods}  # every method's heads, loaded and checked
    _agree_on_trees(attached, cfg.batch_size)
    methods = [m.chosen(attached[m.label], cfg.batch_size) for m in methods]  # `auto`: chosen on this machine
    # and once more with the trees `auto` chose: a resumed run must not mix results of two trees under one label
    run = check_run_file(out_dir, cfg, model_dir, methods, dataset_file(cfg.dataset), replace)
    gens = {label: gen.for_batch(cfg.batch_size) for label, gen in attached.items()}
    _barrier("eval-checked")  # every process has read run.json before process 0 may discard it
    if jax.process_index() == 0:
        if replace:
            discard_run(out_dir)
        elif note := _resume_note(out_dir):
            print(note, file=sys.stderr)
    write_run_file(out_dir, run)  # a barrier first: every process finds the directory discarded
    results_dir = out_dir / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    session = _Session(cfg, base, gens, results_dir)
    run_methods(session, methods, prompts)
    _barrier("eval-generated")
    if jax.process_index() != 0:
        return None
    return summarize(session, methods, prompts, base.config, out_dir, model_dir)
