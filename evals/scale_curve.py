"""The scale curve: each trained head set's held-out agreement with the target (per depth) and its tau against the
tokens it was trained on, one curve per method and tree, from one `amphista-jax eval` run over every head set.

    python -m amphista_jax.evals.scale_curve runs/eval/mt-bench-smollm2-t0-scale --out docs/results/scale

Every method of that eval but AR names a heads directory inside a training run's `out_dir` (`<run>/heads`), whose
`summary.json` gives the tokens it saw; the eval's own summary gives each one's tau and, with `heldout_batches`, its
per-depth agreement on one held-out set shared by all. Writes `scale_curve.{json,md,png}` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from amphista_jax.errors import UserError
from amphista_jax.figures import pyplot, save_figure
from amphista_jax.output_lock import write_atomic


class ScaleCurveError(UserError, ValueError):
    """An eval directory that does not hold what the curve reads."""


def points(eval_dir: str | Path) -> list[dict[str, Any]]:
    """One point per trained head set of the eval in `eval_dir`: its label, method, tree, run directory, tokens
    seen, tau over every prompt and per-depth agreement (empty without the eval's held-out accuracy)."""
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
                    "agreement": [accuracy[k]["agree"] for k in sorted(accuracy, key=int) if "agree" in accuracy[k]]})
    if not out:
        raise ScaleCurveError(f"the eval in {eval_dir} has no trained heads: name training runs' heads in its methods")
    return sorted(out, key=lambda p: (p["method"], p["tree"], p["tokens_seen"]))


def table(rows: list[dict[str, Any]], machine: str) -> str:
    lines = [f"Machine: {machine}", "", "| method | tree | run | tokens seen | held-out agreement per depth | tau |",
             "|---|---|---|---:|---|---:|"]
    for p in rows:
        agreement = " / ".join(f"{a:.3f}" for a in p["agreement"]) or "-"
        lines.append(f"| {p['method']} | {p['tree']} | {p['run']} | {p['tokens_seen'] / 1e6:.2f}M | {agreement} | "
                     f"{p['tau']:.2f} |")
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
    parser.add_argument("eval_dir", help="an `amphista-jax eval` out_dir over the head sets of the curve")
    parser.add_argument("--out", default="runs/benchmarks/scale", help="where scale_curve.{json,md,png} go")
    args = parser.parse_args(argv)
    try:
        rows = points(args.eval_dir)
    except ScaleCurveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    machine = json.loads((Path(args.eval_dir) / "summary.json").read_text())["machine"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "scale_curve.json", json.dumps({"machine": machine, "eval": args.eval_dir, "points": rows},
                                                       indent=2) + "\n")
    write_atomic(out / "scale_curve.md", table(rows, machine) + "\n")
    plot(rows, out / "scale_curve.png")
    print(table(rows, machine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
