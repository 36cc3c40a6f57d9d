"""Step costs measured on the machine that decodes, and `auto`'s choice from them and the shipped acceptance.

A head set's acceptance statistics (`acceptance`) ship with it; what a decode step costs is this machine's. On first
use of a head set here, at each batch size asked for, `calibrate` times each candidate tree's decode step against
autoregressive decoding's, and caches the costs under `AMPHISTA_HOME/calibration/<machine key>.json`
(`machine.Machine.key`: the CPU model and vector extensions or the accelerator, cores, memory and the library's
version, so another version measures again), so later loads reuse them. A damaged cache is said in one line and
measured again; `calibrate --remeasure` measures again on purpose.

What is timed is what the choice depends on, a step's cost relative to AR's: `PAIR_STEPS` decode steps from the state
after the prefill (`step_clock.PairClock`: no prefill, no compile, no whole generation), AR's and a candidate's in
interleaved pairs (`step_clock.time_pairs`), each pair a ratio; the candidate's step costs the median ratio x AR's
step, and the noise of that estimate, which the choice must beat, is the ratios' spread. A machine that drifts, or
that another process slows for a while, slows both programs of a pair alike. Pairs are timed until the estimate is
settled (`settled`: its spread within `MIN_MARGIN`, or the candidate clearly winning or losing), `MIN_PAIRS` to
`MAX_PAIRS` of them; each candidate's noise and pairs are kept and reported.

`plan.choose` is the pure part, the tree plan's rule (`plan.decide`) on these costs: the candidate with the most
predicted tokens per second (tau / its step's cost in AR steps) of those predicted faster than autoregressive
decoding by more than their noise and at least `MIN_MARGIN`; otherwise no speculation.

What is timed is a `Decoder`: the facade's `Generator` as this module uses it (`step_clock.Decoder`).

Candidates are timed in ascending size, and timing stops once no larger candidate can win: a step costs at least as
much as a smaller tree's (more nodes to draft and verify), and no candidate's tau exceeds the best one's, so when the
best tau over the last measured step cannot beat the best so far, the larger candidates are left unmeasured (`None`).
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

import numpy as np

from amphista_jax.choice.acceptance import Acceptance, is_chat_target
from amphista_jax.choice.plan import MIN_MARGIN, StepCosts, choose
from amphista_jax.choice.step_clock import Decoder, PairClock, Pairs, time_pairs
from amphista_jax.infra.compiled_programs import release_if_crowded
from amphista_jax.infra.errors import UserError
from amphista_jax.infra.machine import Machine, cores, this_machine
from amphista_jax.infra.output_lock import write_atomic

PAIR_STEPS = 6  # decode steps in one timing
MIN_PAIRS, MAX_PAIRS = 3, 12  # interleaved (AR, candidate) timings per candidate
CALIBRATION_PROMPT = "Explain, step by step, how a hash map stores and finds a key."  # through the chat template
CALIBRATION_SCRATCH = 256  # cache slots every calibration program keeps beyond the prompt and the new tokens


class CalibrationError(UserError, ValueError):
    """A calibration that cannot be made or read."""


def worth_timing(acceptance: Acceptance, last_ratio: float, best: float, margin: float) -> bool:
    """Whether a candidate larger than the one just timed (a step of `last_ratio` AR steps) could still win: its step
    costs at least as much and its tau is at most the best, so its speed-up is at most best tau / `last_ratio`."""
    return acceptance.best_tau / last_ratio > max(best, 1 + margin)


def settled(pairs: Pairs, tau: float, min_pairs: int = MIN_PAIRS, margin: float = MIN_MARGIN) -> bool:
    """Whether a candidate of `tau` needs no more pairs: at least `min_pairs`, and either its estimate's spread is
    within `margin` (the least margin the choice asks anyway), or it wins (predicted speed-up tau / ratio above
    1 + its spread and `margin`) or loses (below 1 + `margin` even at the favourable end of its spread) whatever
    the estimate's error within that spread."""
    if pairs.count < min_pairs:
        return False
    speedup, spread = tau / pairs.ratio, pairs.spread
    return spread <= margin or speedup > 1 + max(spread, margin) or speedup / (1 - min(spread, 0.5)) <= 1 + margin


def calibration_clock(gen: Decoder, acceptance: Acceptance, batch: int) -> PairClock:
    """`batch` copies of `CALIBRATION_PROMPT` in one cache size for AR and every candidate (`CALIBRATION_SCRATCH`
    slots beyond the prompt and the new tokens, or the largest candidate's scratch if more), so only the step
    differs between the programs timed."""
    prompt = gen.encode(CALIBRATION_PROMPT, chat=is_chat_target(gen.model_dir, gen.tokenizer))
    return PairClock.for_trees([gen], prompt, [c.tree for c in acceptance.candidates], PAIR_STEPS, batch,
                               reserve=CALIBRATION_SCRATCH)


def measure(gen: Decoder, acceptance: Acceptance, clock: PairClock, progress: Callable[[int], object] | None = None
            ) -> StepCosts:
    """Time the candidates on `clock` in ascending size against AR, in interleaved pairs until `settled`, stopping
    early (`worth_timing`). Programs are compiled a few at a time, concurrently (`PairClock.start_all`: AR's with the
    first candidate's, then as many as this machine has cores, each tree from the first's prefill), and timed only
    once none is compiling. AR's step: the median of all its timings. `progress(n)` counts candidates timed."""
    candidates = acceptance.candidates
    ar, first = clock.start_all([gen.autoregressive(), gen.with_tree(candidates[0].tree)])
    ready = {0: first}
    timed: list[Pairs] = []  # per candidate timed, in order; the rest are left unmeasured
    best = 0.0
    for i, candidate in enumerate(candidates):
        if timed and not worth_timing(acceptance, timed[-1].ratio, best, MIN_MARGIN):
            break
        if i not in ready:
            ahead = range(i, min(len(candidates), i + cores()))
            ready |= dict(zip(ahead, clock.start_all([gen.with_tree(candidates[j].tree) for j in ahead], first),
                              strict=True))
        started = ready.pop(i)
        timed.append(time_pairs(lambda: clock.time(ar), lambda s=started: clock.time(s),
                                lambda p, tau=candidate.tau: settled(p, tau), MAX_PAIRS))
        release_if_crowded()  # a program per candidate: past the memory-mapping limit otherwise
        best = max(best, candidate.tau / timed[-1].ratio)
        if progress:
            progress(1)
    ar_ms = float(np.median([s for p in timed for s in p.a_s])) / clock.steps * 1e3
    untimed = (None,) * (len(candidates) - len(timed))
    return StepCosts(int(clock.tokens.shape[0]), ar_ms, tuple(p.ratio * ar_ms for p in timed) + untimed,
                     tuple(p.spread for p in timed) + untimed, 0.0, tuple(p.count for p in timed) + untimed)


def cost_key(gen: Decoder, batch: int, acceptance: Acceptance) -> str:
    """What step costs depend on besides the machine: the target's shape, the dtype, the attention, the mesh, the
    batch size, the calibration's settings, the drafter with its settings and the candidates -- not the weights'
    values."""
    what = {"config": dataclasses.asdict(gen.config), "dtype": gen.dtype, "attention": gen.attention,
            "mesh": None if gen.mesh is None else dict(gen.mesh.shape), "batch": batch, "timing": "pairs",
            "steps": PAIR_STEPS, "pairs": [MIN_PAIRS, MAX_PAIRS, MIN_MARGIN], "prompt": CALIBRATION_PROMPT,
            "scratch": CALIBRATION_SCRATCH,
            "drafter": repr(gen.drafter),
            "candidates": [c.to_json() | {"tau": None} for c in acceptance.candidates]}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_file(machine: Machine | None = None) -> Path:
    """This machine's calibration cache (`AMPHISTA_HOME/calibration/<machine key>.json`)."""
    from amphista_jax.infra.home import amphista_home

    return amphista_home() / "calibration" / f"{(machine or this_machine()).key()}.json"


def read_cache(path: Path) -> dict[str, Any]:
    """The cached entries (`{key: {"label", "costs"}}`), or none, with a line on stderr, where the file is
    damaged. Entries of an earlier layout (AR timed alone, or whole decodes timed one program after another) are left
    out, and so measured again."""
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())["entries"]
        return {k: e for k, e in entries.items() if _current(e)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"note: calibration cache {path} is damaged ({type(e).__name__}: {e}); measuring again",
              file=sys.stderr)
        return {}


def _current(entry: dict[str, Any]) -> bool:
    """Whether a cache entry holds step costs in today's layout."""
    try:
        StepCosts.from_json(entry["costs"])
        return True
    except (KeyError, TypeError, ValueError):
        return False


def calibrate(gen: Decoder, acceptance: Acceptance, batch: int, remeasure: bool = False) -> StepCosts:
    """This machine's step costs for `gen`'s drafter and `acceptance`'s candidates at `batch` rows: cached, else
    measured (`measure`, a progress line on stderr) and cached. `remeasure` measures again and replaces the cached
    costs."""
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
        costs = dataclasses.replace(measure(gen, acceptance, clock, bar.update), seconds=time.perf_counter() - t0)
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
    """Markdown: each candidate's tau, and per batch size its step cost, predicted speed-up (`*` where picked) and
    noise (in how many pairs)."""
    head = "| tree | draft nodes | tau | " + " | ".join(f"batch {c.batch}: step ms, speed-up, noise" for c in costs)
    head += " |"
    rows = [head, "|---|---|---|" + "---|" * len(costs),
            "| AR | 0 | 1.00 | " + " | ".join(f"{c.ar_ms:.1f}, 1.00x" for c in costs) + " |"]
    decisions = [choose(acceptance, c) for c in costs]
    for i, cand in enumerate(acceptance.candidates):
        cells = []
        for c, d in zip(costs, decisions, strict=True):
            s = c.step_ms[i]
            cells.append("not timed (no larger tree can win)" if s is None else
                         f"{s:.1f}, {d.speedups[i]:.2f}x" + (" *" if d.index == i else "") +
                         (f", noise {c.noise[i]:.1%} in {c.pairs[i]} pairs" if c.pairs else ""))
        rows.append(f"| {cand.name} | {cand.nodes} | {cand.tau:.2f} | " + " | ".join(cells) + " |")
    rows += ["", *(f"- {d.describe(acceptance)} (calibrated in {c.seconds:.0f} s)"
                   for c, d in zip(costs, decisions, strict=True))]
    return "\n".join(rows) + "\n"
