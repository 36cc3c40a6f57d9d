"""The scale curve: each trained head set's held-out agreement with the target (per depth) and its tau against the
tokens it was trained on, one curve per method and tree, from `amphista-jax eval` runs over the head sets.

    amphista-jax eval --config configs/eval/results/mt-bench-smollm2-t0-scale.yaml --set out_dir=runs/eval/scale/4x \
        --methods ar amphista-4x=runs/smollm2/scale/amphista-4x/heads@mc_sim_7b_63
    python -m amphista_jax.evals.scale_curve runs/eval/scale/4x --out docs/results/scale

Every method of an eval but AR names a heads directory inside a training run's `out_dir` (`<run>/heads`), whose
`summary.json` gives the tokens it saw; the eval's own summary gives each one's tau and, with `heldout_batches`, its
per-depth agreement on the held-out set. The points already in `--out`'s `scale_curve.json` are kept (a point of
the same run and tree is replaced), so a curve grows one training run at a time and outlives the runs' heads;
every point carries the machine and the eval settings it was measured with, and points measured with other
settings (prompts, tokens, temperature, held-out set, ...) are refused. Tau at T=0 on a named tree belongs to the
heads and the prompts, not to the machine (`auto` picks a tree per machine); no speed is compared across points.
Writes `scale_curve.{json,md,png}` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from amphista_jax.evals.run_record import RESULT_SETTINGS
from amphista_jax.infra.errors import UserError
from amphista_jax.infra.figures import pyplot, save_figure
from amphista_jax.infra.identity import changes
from amphista_jax.infra.output_lock import write_atomic

CURVE_FILE = "scale_curve.json"


class ScaleCurveError(UserError, ValueError):
    """An eval directory that does not hold what the curve reads, or points measured otherwise than the curve's."""


def eval_settings(config: dict[str, Any]) -> dict[str, Any]:
    """How an eval measured its methods: of its stored config, the dataset and the settings its results depend on
    (`RESULT_SETTINGS`, what a resumed eval must keep)."""
    return {k: config.get(k) for k in ("dataset", *RESULT_SETTINGS)}  # one missing from an older eval: None


def points(eval_dir: str | Path) -> list[dict[str, Any]]:
    """One point per trained head set of the eval in `eval_dir`: its label, method, tree, run directory, tokens
    seen, tau over every prompt, per-depth agreement (empty without the eval's held-out accuracy), and the machine,
    eval directory and eval settings it was measured with."""
    path = Path(eval_dir) / "summary.json"
    if not path.is_file():
        raise ScaleCurveError(f"{path} does not exist: run `amphista-jax eval` into {eval_dir} first")
    summary = json.loads(path.read_text())
    out = []
    for m in summary["methods"]:
        if m["method"] == "ar":
            continue
        run = Path(m["spec"].split("=", 1)[-1].rsplit("@", 1)[0]).parent  # label=<run>/heads@tree
        if not (run / "summary.json").is_file():
            raise ScaleCurveError(f"method {m['label']}: {run / 'summary.json'} does not exist: its heads must be a "
                                  "training run's (`<out_dir>/heads`)")
        trained = json.loads((run / "summary.json").read_text())
        accuracy = summary.get("head_accuracy", {}).get(m["label"], {})
        out.append({"label": m["label"], "method": m["method"], "tree": m.get("tree", "auto"), "run": str(run),
                    "tokens_seen": trained["tokens_seen"], "tau": summary["metrics"][m["label"]]["overall"]["tau"],
                    "agreement": [accuracy[k]["agree"] for k in sorted(accuracy, key=int) if "agree" in accuracy[k]],
                    "machine": summary["machine"], "eval": str(eval_dir),
                    "settings": eval_settings(summary["config"])})
    if not out:
        raise ScaleCurveError(f"the eval in {eval_dir} has no trained heads: name training runs' heads in its methods")
    return out


def kept_points(out: Path) -> list[dict[str, Any]]:
    """The points of the curve already in `out` (none without its file)."""
    if not (path := out / CURVE_FILE).is_file():
        return []
    kept = json.loads(path.read_text())["points"]
    if any("settings" not in p for p in kept):
        raise ScaleCurveError(f"{path} holds points without the eval settings they were measured with: write this "
                              "curve to another --out")
    return kept


def merged(kept: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`kept` with `new` added, a new point replacing a kept one of the same run and tree; every point measured
    with the same eval settings (else ScaleCurveError), in (method, tree, tokens) order."""
    reference = (kept or new)[0]
    for p in new:
        if changed := changes(reference["settings"], p["settings"]):
            raise ScaleCurveError(f"{p['label']} ({p['eval']}) was measured with other eval settings than "
                                  f"{reference['label']} ({reference['eval']}): {', '.join(changed)} differ; "
                                  "evaluate it with the curve's config, or write another curve (--out)")
    replaced = {(p["run"], p["tree"]) for p in new}
    rows = [p for p in kept if (p["run"], p["tree"]) not in replaced] + new
    return sorted(rows, key=lambda p: (p["method"], p["tree"], p["tokens_seen"]))


def table(rows: list[dict[str, Any]]) -> str:
    machines = list(dict.fromkeys(p["machine"] for p in rows))
    lines = [*(f"Machine {i + 1}: {m}" for i, m in enumerate(machines)), "",
             "| method | tree | run | tokens seen | held-out agreement per depth | tau | machine |",
             "|---|---|---|---:|---|---:|---:|"]
    for p in rows:
        agreement = " / ".join(f"{a:.3f}" for a in p["agreement"]) or "-"
        lines.append(f"| {p['method']} | {p['tree']} | {p['run']} | {p['tokens_seen'] / 1e6:.2f}M | {agreement} | "
                     f"{p['tau']:.2f} | {machines.index(p['machine']) + 1} |")
    return "\n".join(lines)


def agreement_curves(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per method, one point per trained run with agreement, in token order: agreement belongs to the heads, so a
    run the eval decodes on several trees is one point."""
    curves: dict[str, dict[str, dict[str, Any]]] = {}
    for p in rows:
        if p["agreement"]:
            curves.setdefault(p["method"], {}).setdefault(p["run"], p)
    return {m: sorted(runs.values(), key=lambda p: p["tokens_seen"]) for m, runs in curves.items()}


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Depth-1 agreement against tokens seen (log scale), one line per method; tau, one line per (method, tree)."""
    plt = pyplot()
    fig, (ax_agree, ax_tau) = plt.subplots(1, 2, figsize=(10, 4))
    for method, curve in agreement_curves(rows).items():
        ax_agree.plot([p["tokens_seen"] for p in curve], [p["agreement"][0] for p in curve], "o-", label=method)
    for key in dict.fromkeys((p["method"], p["tree"]) for p in rows):
        curve = [p for p in rows if (p["method"], p["tree"]) == key]
        ax_tau.plot([p["tokens_seen"] for p in curve], [p["tau"] for p in curve], "o-", label=f"{key[0]} @{key[1]}")
    ax_agree.set(xscale="log", xlabel="tokens seen", ylabel="held-out agreement, depth 1",
                 title="agreement with the target")
    ax_tau.set(xscale="log", xlabel="tokens seen", ylabel="tau", title="tokens per target forward")
    for ax in (ax_agree, ax_tau):
        if ax.lines:
            ax.legend()
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("eval_dirs", nargs="+", help="`amphista-jax eval` out_dirs over head sets of the curve")
    parser.add_argument("--out", default="runs/benchmarks/scale",
                        help=f"where scale_curve.{{json,md,png}} go; the points of its {CURVE_FILE} are kept")
    args = parser.parse_args(argv)
    out = Path(args.out)
    try:
        rows = merged(kept_points(out), [p for eval_dir in args.eval_dirs for p in points(eval_dir)])
    except ScaleCurveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / CURVE_FILE, json.dumps({"points": rows}, indent=2) + "\n")
    write_atomic(out / "scale_curve.md", table(rows) + "\n")
    plot(rows, out / "scale_curve.png")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
