"""Step costs measured on the machine that decodes, and `auto`'s choice from them and the shipped acceptance.

A head set's acceptance statistics (`acceptance`) ship with it; what a decode step costs is this machine's. On first
use of a head set here, at each batch size asked for, `calibrate` times the real decode loop (`step_clock.StepClock`)
of the candidate trees, in ascending size, against autoregressive decoding's (timed in the same process, before and
after the candidates: a machine's speed drifts between processes by about the calibration's noise, so a ratio of
two processes' timings is not a speed-up), and caches the costs under `AMPHISTA_HOME/calibration/<machine key>.json`
(`machine.Machine.key`: the CPU model and vector extensions or the accelerator, cores, memory and the library's
version), so later loads reuse them. A damaged cache is said in one line and measured again.

`plan.choose` is the pure part, the tree plan's rule (`plan.decide`) on these costs: the candidate with the most
predicted tokens per second (tau x AR step / step), kept only if its predicted speed-up beats autoregressive decoding
by more than the calibration's noise (the largest spread of any program's timed runs) and at least `MIN_MARGIN`;
otherwise no speculation.

What is timed is a `Decoder`: the facade's `Generator` as this module uses it (`step_clock.Decoder`).

Timing stops early once no larger candidate can win: a step costs at least as much as a smaller tree's (more nodes
to draft and verify), and no candidate's tau exceeds the best one's, so when the best tau over the last measured
step cannot beat the best so far, the larger candidates are left unmeasured (`None`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from amphista_jax.choice.acceptance import Acceptance, is_chat_target
from amphista_jax.choice.plan import MIN_MARGIN, StepCosts, choose
from amphista_jax.choice.step_clock import Decoder, StepClock
from amphista_jax.infra.compiled_programs import release_if_crowded
from amphista_jax.infra.errors import UserError
from amphista_jax.infra.machine import Machine, this_machine
from amphista_jax.infra.output_lock import write_atomic

CALIBRATION_TOKENS = 24  # decode steps timed per program (no EOS stop)
CALIBRATION_RUNS = 2  # timed runs per program after its compile and warm-up run (the fastest kept)
CALIBRATION_PROMPT = "Explain, step by step, how a hash map stores and finds a key."  # through the chat template
CALIBRATION_SCRATCH = 256  # cache slots every calibration program keeps beyond the prompt and the new tokens


class CalibrationError(UserError, ValueError):
    """A calibration that cannot be made or read."""


def worth_timing(acceptance: Acceptance, ar_ms: float, last_ms: float, best: float, margin: float) -> bool:
    """Whether a candidate larger than the one just timed (`last_ms` a step) could still win: its step costs at
    least `last_ms` and its tau is at most the best, so its speed-up is at most best tau x AR step / `last_ms`."""
    return acceptance.best_tau * ar_ms / last_ms > max(best, 1 + margin)


@dataclasses.dataclass(frozen=True)
class ARCosts:
    """The target's own costs at one batch size and cache size, timed beside the candidates they price."""

    prefill_ms: float
    step_ms: float
    spread: float  # relative spread of its timed runs

    @staticmethod
    def around(before: ARCosts, after: ARCosts) -> ARCosts:
        """AR timed before and after the candidates, as one: the faster of each, with the two steps' relative
        difference counted in the spread (drift while the candidates ran is noise the choice must beat)."""
        step = min(before.step_ms, after.step_ms)
        drift = abs(before.step_ms - after.step_ms) / step
        return ARCosts(min(before.prefill_ms, after.prefill_ms), step, max(before.spread, after.spread, drift))


def calibration_clock(gen: Decoder, acceptance: Acceptance, batch: int) -> StepClock:
    """`batch` copies of `CALIBRATION_PROMPT` in one cache size for AR and every candidate (`CALIBRATION_SCRATCH`
    slots beyond the prompt and the new tokens, or the largest candidate's scratch if more), so only the step
    differs between the programs timed."""
    prompt = gen.encode(CALIBRATION_PROMPT, chat=is_chat_target(gen.model_dir, gen.tokenizer))
    return StepClock.for_trees([gen], prompt, [c.tree for c in acceptance.candidates], CALIBRATION_TOKENS,
                               CALIBRATION_RUNS, batch, reserve=CALIBRATION_SCRATCH)


def measure_ar(gen: Decoder, clock: StepClock) -> ARCosts:
    """The target's prefill (a one-token decode) and AR step on `clock`."""
    step, spread, prefill = clock.step_timing(gen.autoregressive())
    return ARCosts(prefill * 1e3, step * 1e3, spread)


def measure(gen: Decoder, acceptance: Acceptance, clock: StepClock, ar: ARCosts,
            progress: Callable[[int], object] | None = None
            ) -> StepCosts:
    """Time the candidates on `clock` in ascending size, stopping early (`worth_timing`, against `ar`: AR timed
    first, in this process). The speculative programs' prefill is priced as AR's (a drafter's own prefill, a few per
    cent of the timed steps, then counts as step cost: it errs towards AR). `noise`: the largest spread of any
    program's timed runs, AR's included. `progress(n)` counts candidates timed."""
    steps: list[float | None] = []
    spreads, best, last = [ar.spread], 0.0, None
    for candidate in acceptance.candidates:
        if last is not None and not worth_timing(acceptance, ar.step_ms, last, best, MIN_MARGIN):
            steps.append(None)
            continue
        step, spread, _ = clock.step_timing(gen.with_tree(candidate.tree), ar.prefill_ms / 1e3)
        last = step * 1e3
        release_if_crowded()  # a program per candidate: past the memory-mapping limit otherwise
        steps.append(last)
        spreads.append(spread)
        best = max(best, candidate.tau * ar.step_ms / last)
        if progress:
            progress(1)
    return StepCosts(int(clock.tokens.shape[0]), ar.step_ms, tuple(steps), max(spreads), 0.0)


def cost_key(gen: Decoder, batch: int, acceptance: Acceptance) -> str:
    """What step costs depend on besides the machine: the target's shape, the dtype, the attention, the mesh, the
    batch size, the calibration's settings, the drafter with its settings and the candidates -- not the weights'
    values."""
    what = {"config": dataclasses.asdict(gen.config), "dtype": gen.dtype, "attention": gen.attention,
            "mesh": None if gen.mesh is None else dict(gen.mesh.shape), "batch": batch, "tokens": CALIBRATION_TOKENS,
            "runs": CALIBRATION_RUNS, "prompt": CALIBRATION_PROMPT, "scratch": CALIBRATION_SCRATCH,
            "drafter": repr(gen.drafter),
            "candidates": [c.to_json() | {"tau": None} for c in acceptance.candidates]}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_file(machine: Machine | None = None) -> Path:
    """This machine's calibration cache (`AMPHISTA_HOME/calibration/<machine key>.json`)."""
    from amphista_jax.models.fetch import amphista_home

    return amphista_home() / "calibration" / f"{(machine or this_machine()).key()}.json"


def read_cache(path: Path) -> dict[str, Any]:
    """The cached entries (`{key: {"label", "costs"}}`), or none, with a line on stderr, where the file is
    damaged. Entries of AR timed alone (an earlier layout, reused across processes) are left out."""
    if not path.is_file():
        return {}
    try:
        entries = {k: e for k, e in json.loads(path.read_text())["entries"].items() if "ar" not in e}
        for entry in entries.values():
            StepCosts.from_json(entry["costs"])
        return entries
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"note: calibration cache {path} is damaged ({type(e).__name__}: {e}); measuring again",
              file=sys.stderr)
        return {}


def calibrate(gen: Decoder, acceptance: Acceptance, batch: int, remeasure: bool = False) -> StepCosts:
    """This machine's step costs for `gen`'s drafter and `acceptance`'s candidates at `batch` rows: cached, else
    measured (a progress line on stderr), AR before and after the candidates (`ARCosts.around`), and cached.
    `remeasure` measures again and replaces the cached costs."""
    from tqdm import tqdm

    path, key = cache_file(), cost_key(gen, batch, acceptance)
    entries = read_cache(path)
    if key in entries and not remeasure:
        return StepCosts.from_json(entries[key]["costs"])
    t0 = time.perf_counter()
    clock = calibration_clock(gen, acceptance, batch)
    target = Path(gen.model_dir).name or "target"
    with tqdm(total=len(acceptance.candidates), desc=f"calibrating {gen.method} trees at batch {batch} on this "
              "machine", unit="tree", file=sys.stderr) as bar:
        first = measure_ar(gen, clock)
        costs = measure(gen, acceptance, clock, first, bar.update)
        ar = ARCosts.around(first, measure_ar(gen, clock))
    costs = dataclasses.replace(costs, ar_ms=ar.step_ms, noise=max(costs.noise, ar.spread),
                                seconds=time.perf_counter() - t0)
    entries = entries | {key: {"label": f"{gen.method} on {target}, batch {batch}", "costs": costs.to_json()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"machine": dataclasses.asdict(this_machine()), "entries": entries}, indent=1)
                     + "\n")
    except OSError as e:
        print(f"note: the calibration cannot be cached in {path} ({e.strerror or e}); it is measured again next time",
              file=sys.stderr)
    return costs


def table(acceptance: Acceptance, costs: Sequence[StepCosts]) -> str:
    """Markdown: each candidate's tau, and per batch size its step cost and predicted speed-up (`*` where picked)."""
    head = "| tree | draft nodes | tau | " + " | ".join(f"batch {c.batch}: step ms, speed-up" for c in costs) + " |"
    rows = [head, "|---|---|---|" + "---|" * len(costs),
            "| AR | 0 | 1.00 | " + " | ".join(f"{c.ar_ms:.1f}, 1.00x" for c in costs) + " |"]
    decisions = [choose(acceptance, c) for c in costs]
    for i, cand in enumerate(acceptance.candidates):
        cells = []
        for c, d in zip(costs, decisions, strict=True):
            s = c.step_ms[i]
            cells.append("not timed (no larger tree can win)" if s is None else
                         f"{s:.1f}, {d.speedups[i]:.2f}x" + (" *" if d.index == i else ""))
        rows.append(f"| {cand.name} | {cand.nodes} | {cand.tau:.2f} | " + " | ".join(cells) + " |")
    rows += ["", *(f"- {d.describe(acceptance)} (noise {c.noise:.1%}, calibrated in {c.seconds:.0f} s)"
                   for c, d in zip(costs, decisions, strict=True))]
    return "\n".join(rows) + "\n"
