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

Every input is checked before the target is loaded: the config (`amphista_jax.evals.config`), the dataset, each
method spec and, when resuming, that `run.json` records the same settings and the same content (sha256) of the
target, the heads and the dataset (`amphista_jax.evals.run_record`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
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
from amphista_jax.evals.config import EvalConfig
from amphista_jax.evals.datasets import Prompt, dataset_file, load_prompts, render_turn
from amphista_jax.evals.head_accuracy import head_accuracy, heldout_batches
from amphista_jax.evals.methods import Method, resolve_methods
from amphista_jax.evals.metrics import breakdown, lossless_mismatches, tree_statistics
from amphista_jax.evals.report import write_reports
from amphista_jax.evals.results import ResultWriter, process_file, read_results, safe_label
from amphista_jax.evals.run_record import check_run_file, discard_run, resume_note, write_run_file
from amphista_jax.facade.generator import Generator
from amphista_jax.infra.compiled_programs import release_if_crowded
from amphista_jax.infra.errors import check_writable_dir
from amphista_jax.infra.machine import this_machine
from amphista_jax.infra.output_lock import output_lock, write_atomic
from amphista_jax.models.fetch import default_model, resolve_model
from amphista_jax.models.hf import load_config
from amphista_jax.models.target import Target
from amphista_jax.train.config import MeshConfig
from amphista_jax.train.loop import maybe_initialize_distributed
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.verify import AcceptanceConfig


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
        elif note := resume_note(out_dir):
            print(note, file=sys.stderr)
    _barrier("eval-run-file")  # every process has checked run.json and finds the directory discarded
    write_run_file(out_dir, run)
    results_dir = out_dir / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    session = _Session(cfg, base, gens, results_dir)
    run_methods(session, methods, prompts)
    _barrier("eval-generated")
    if jax.process_index() != 0:
        return None
    return summarize(session, methods, prompts, base.config, out_dir, model_dir)
