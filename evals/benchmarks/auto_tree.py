"""`--tree auto` on this machine against plain decoding: each shipped head set on the tree its calibration picks here.

    python -m amphista_jax.evals.benchmarks.auto_tree --model smollm2 --prompts 12 [--candidates]

For each method, the tree `auto` picks on this machine (calibrated on first use, the calibration's time reported,
and the margin its pick, or its best candidate, had to beat, with the interleaved pairs that measured it),
then greedy decoding of the first `--prompts` MT-Bench first turns (chat template, batch 1, `--max-new-tokens`), AR
timed first and last and the methods between them (each after a compiling warm-up), every output checked equal to
AR's. With `--candidates`, every candidate tree of every method is also decoded on the same prompts, so the pick can
be compared with the fastest candidate measured. Where a head set ships the step costs of the developers' machine
(`trees/cpu.report.json`, batch 1), the tree `auto` would pick there is given beside (the other machine's costs,
this choice rule). Writes `auto_tree.{json,md}` under `--out`, naming the machine.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from amphista_jax.choice.acceptance import Acceptance
from amphista_jax.choice.calibration import StepCosts, calibrate, choose
from amphista_jax.choice.plan import TreePlan
from amphista_jax.evals.benchmarks.common import benchmark_parser, write_report
from amphista_jax.evals.datasets import DatasetConfig, load_prompts
from amphista_jax.facade.drafter_source import read_source
from amphista_jax.facade.generator import Generator
from amphista_jax.models.fetch import resolve_data

METHODS = ("eagle3", "amphista", "medusa", "sar", "bita", "eagle", "prompt_lookup")


@dataclasses.dataclass(frozen=True)
class Run:
    seconds: float
    tokens: int
    ids: list[list[int]]
    tau: float  # mean over prompts

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def decode_all(gen: Generator, prompts: list[list[int]], max_new_tokens: int) -> Run:
    """Greedy decoding of every prompt at batch 1, after a compiling warm-up."""
    gen.generate(prompts[0], max_new_tokens=max_new_tokens)
    outs = [gen.generate(p, max_new_tokens=max_new_tokens) for p in prompts]
    return Run(sum(o.seconds for o in outs), sum(o.new_tokens for o in outs), [o.token_ids[0] for o in outs],
               float(np.mean([o.tau[0] for o in outs])))


def costs_elsewhere(heads_dir: str | None, stats: Acceptance) -> StepCosts | None:
    """The developers' machine's batch-1 step costs of these candidates, from the tree search shipped beside the heads
    (its trees of the same number of draft nodes; None where it timed none of that size)."""
    report = Path(heads_dir or "") / "trees" / "cpu.report.json"
    if not heads_dir or not report.is_file():
        return None
    r = json.loads(report.read_text())
    by_nodes = {t["draft_nodes"]: t["step_ms"] for t in r["trees"]}
    steps = tuple(by_nodes.get(c.nodes) if c.name.startswith("grown-") else None for c in stats.candidates)
    noise = tuple(None if s is None else 0.0 for s in steps)  # none known: the rule's floor margin
    return StepCosts(1, r["ar_step_ms"], steps, noise, 0.0) if any(s is not None for s in steps) else None


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--candidates", action="store_true", help="also decode on every candidate tree")
    args = parser.parse_args()
    base = Generator.load(args.model or "smollm2")
    if missing := [m for m in args.methods if read_source(m, base.model_dir, base.config).acceptance is None]:
        raise SystemExit(f"no acceptance statistics ship for {', '.join(missing)} on this target: "
                         "`amphista-jax calibrate --acceptance --heads <method>`, or leave them out (--methods)")
    data, _ = load_prompts(DatasetConfig("mt_bench", resolve_data("mt-bench"), limit=args.prompts, turns=1))
    prompts = [base.encode(p.turns[0], chat=True) for p in data]
    local: dict[str, tuple[Generator, TreePlan]] = {}  # each method's generator under `auto`, and its plan
    gens: dict[str, Generator] = {}  # each on the tree auto picks at batch 1 (AR where it picks none)
    rows: dict[str, dict[str, Any]] = {}
    for method in args.methods:
        t0 = time.perf_counter()
        gen = base.with_drafter(method, "auto")
        if gen.policy is None or not gen.policy.chooses_here:  # no candidate its settings can draft
            raise SystemExit(f"{method}: `auto` fell back to its paper's tree ({'; '.join(gen.notes)})")
        local[method], gens[method] = (gen, trees := gen.policy), gen.for_batch(1)
        costs = calibrate(gen, trees.acceptance, 1)
        elsewhere = costs_elsewhere(gen.heads_dir, trees.acceptance)
        other = choose(trees.acceptance, elsewhere) if elsewhere is not None else None
        rows[method] = {"picked": trees.label(1), "why": trees.describe(1), "predicted": trees.decision(1).speedups,
                        "candidates": [c.to_json() for c in trees.acceptance.candidates],
                        "step_ms": costs.step_ms, "ar_step_ms": costs.ar_ms, "noise": costs.noise,
                        "pairs": costs.pairs, "margin": trees.decision(1).margin,
                        "best_pairs": costs.pairs[trees.decision(1).best],
                        "calibration_s": costs.seconds, "load_and_choose_s": time.perf_counter() - t0,
                        "picked_on_developers_machine": None if other is None else (
                            "none" if other.index is None else trees.acceptance.candidates[other.index].name),
                        "predicted_there": None if other is None else other.speedups[other.best]}
    ar = base.autoregressive()
    first = decode_all(ar, prompts, args.max_new_tokens)
    for method, (auto, trees) in local.items():
        run = decode_all(gens[method], prompts, args.max_new_tokens)
        rows[method] |= {"seconds": run.seconds, "tokens": run.tokens, "identical": run.ids == first.ids,
                         "tau": run.tau}
        if args.candidates:
            measured = {}
            for c in trees.acceptance.candidates:
                m = decode_all(auto.with_tree(c.tree), prompts, args.max_new_tokens)
                measured[c.name] = {"tokens_per_s": m.tokens_per_s, "tau": m.tau, "identical": m.ids == first.ids}
            rows[method]["candidates_measured"] = measured
    last = decode_all(ar, prompts, args.max_new_tokens)
    ar_tps = (first.tokens_per_s + last.tokens_per_s) / 2
    lines = [f"`--tree auto` on this machine: {len(prompts)} MT-Bench first turns, batch 1, {args.max_new_tokens} new "
             f"tokens, T=0. AR {ar_tps:.1f} tokens/s (first {first.tokens_per_s:.1f}, last {last.tokens_per_s:.1f}: "
             f"AR against itself {last.tokens_per_s / first.tokens_per_s:.2f}x). Command: `python -m "
             f"amphista_jax.evals.benchmarks.auto_tree --prompts {len(prompts)}"
             f"{' --candidates' if args.candidates else ''}`.", "",
             "| method | auto's pick here | tau | speed-up | identical to AR | calibration s | margin (pairs) | "
             "fastest candidate measured | pick on the developers' machine (its costs) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, r in rows.items():
        r["speedup"] = r["tokens"] / r["seconds"] / ar_tps
        best = "-"
        if "candidates_measured" in r:
            name, m = max(r["candidates_measured"].items(), key=lambda kv: kv[1]["tokens_per_s"])
            best = f"{name} {m['tokens_per_s'] / ar_tps:.2f}x"
        there = "-" if r["picked_on_developers_machine"] is None else \
            f"{r['picked_on_developers_machine']} (predicted {r['predicted_there']:.2f}x)"
        lines.append(f"| {method} | {r['picked']} | {r['tau']:.2f} | {r['speedup']:.2f}x | "
                     f"{'yes' if r['identical'] else 'NO'} | {r['calibration_s']:.0f} | "
                     f"{r['margin']:.1%} ({r['best_pairs']}) | {best} | {there} |")
    lines += ["", *(f"- {m}: {r['why']}" for m, r in rows.items())]
    write_report(args.out, "auto_tree", {"ar_tokens_per_s": ar_tps, "ar_first": first.tokens_per_s,
                                         "ar_last": last.tokens_per_s, "prompts": len(prompts),
                                         "max_new_tokens": args.max_new_tokens, "methods": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
