"""Speed-up against batch size: measured on this machine and predicted for accelerators, one table and one PNG.

    python -m amphista_jax.evals.benchmarks.batch_speedup --measured runs/eval/B1 runs/eval/B4 runs/eval/B16
        --predicted runs/roofline-vicuna/roofline.json runs/roofline-llama3/roofline.json
        [--steps docs/gpu/step_time-llama-3-8b-h200.json] [--tau 3] [--accelerator H100-SXM] [--out docs]

Measured: each `--measured` directory is one evaluation run (`amphista-jax eval`, its `summary.json`) at one batch
size; every speed-up in it is a ratio measured in that run (AR first, the same prompts and settings for every
method), so a column of the table compares methods measured together, and a row follows one method across runs.
Predicted: each `--predicted` file is a roofline run (`roofline.py`, one target, several batch sizes), whose
speed-up at acceptance length `--tau` is `tau * AR step / spec step` on `--accelerator`: a model prediction from
the compiled steps' FLOPs and bytes, not a measurement. For both, "off from" is the smallest batch size at which
the method is slower than AR (speculation should be switched off there: `tree-search --batch-sizes` stores that
as `none`), or "-" when it wins at every batch size shown. Measured steps: each `--steps` file is a step-time run
(`step_time.py`, e.g. a known shape with random weights on a GPU), whose measured step / AR step ratio gives the
speed-up `tau / ratio` at the same `--tau`: measured step costs, an assumed acceptance length.
Writes batch_speedup.json, .md and .png to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from amphista_jax.evals.benchmarks.common import write_report
from amphista_jax.evals.benchmarks.roofline import run_label
from amphista_jax.evals.report import ar_timed_again
from amphista_jax.infra.errors import UserError
from amphista_jax.infra.figures import pyplot, save_figure

Curves = dict[str, dict[int, float]]  # series label -> {batch size: speed-up}


class BatchSpeedupError(UserError, ValueError):
    """An input that is not an evaluation run or a roofline run of the kind this benchmark reads."""


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BatchSpeedupError(f"{path}: not a readable {what} ({e}); pass the directory `amphista-jax eval` "
                                "wrote, or the JSON roofline.py wrote") from None


@dataclasses.dataclass(frozen=True)
class Measured:
    """What evaluation runs (one batch size each) measured, per method label and batch size."""

    speedup: Curves
    tau: Curves
    picks: dict[str, dict[int, str]]  # `auto` methods: the tree auto picked there on its machine ("AR": none)
    noise: tuple[str, ...]  # labels of AR timed again (a later `ar` spec): the runs' timing noise, not a method
    settings: dict[str, Any]


def measured_curves(run_dirs: list[Path]) -> Measured:
    """The curves of evaluation runs, one batch size each; refuses runs on different targets, temperatures or
    token budgets, or two runs at one batch."""
    speedup: Curves = {}
    tau: Curves = {}
    picks: dict[str, dict[int, str]] = {}
    noise: list[str] = []
    shared: dict[str, Any] | None = None
    for run in run_dirs:
        summary = _read_json(run / "summary.json", "evaluation summary")
        cfg = summary["config"]
        batch = int(cfg["batch_size"])
        settings = {"model": summary["model"], "temperature": cfg["temperature"],
                    "max_new_tokens": cfg["max_new_tokens"], "backend": summary["backend"]}
        if shared is not None and settings != shared:
            raise BatchSpeedupError(f"{run}: {settings} differs from the first run's {shared}: compare runs on one "
                                    "target, temperature and token budget")
        shared = settings
        if any(batch in curve for curve in speedup.values()):
            raise BatchSpeedupError(f"{run}: a second run at batch size {batch}: pass one run per batch size")
        again = ar_timed_again(summary["methods"])
        for method in summary["methods"]:
            label = method["label"]
            if label == "ar":
                continue
            if label in again and label not in noise:
                noise.append(label)
            if method["tree"].startswith("auto"):
                nodes = method["tree_nodes"] - 1  # the root is the last committed token, not a draft
                picks.setdefault(label, {})[batch] = f"{nodes} nodes" if nodes > 0 else "AR"
            overall = summary["metrics"][label]["overall"]
            speedup.setdefault(label, {})[batch] = overall["speedup"]
            tau.setdefault(label, {})[batch] = overall["tau"]
    return Measured(speedup, tau, picks, tuple(noise), shared or {})


def predicted_curves(roofline_files: list[Path], accelerator: str, tau: float) -> Curves:
    """{"<target> <method>@<tree>": {batch: predicted speed-up at `tau` on `accelerator`}} from roofline runs
    (their smallest context)."""
    curves: Curves = {}
    for path in roofline_files:
        report = _read_json(path, "roofline report")
        rows = [r for r in report["rows"] if r["method"] != "ar"]
        if not rows or accelerator not in rows[0]["speedup"] or str(tau) not in rows[0]["speedup"][accelerator]:
            raise BatchSpeedupError(f"{path}: no speed-up at tau {tau} on {accelerator}: rerun roofline.py with "
                                    f"--tau {tau:g} and --accelerators {accelerator}")
        context = min(r["context"] for r in rows)
        for r in rows:
            if r["context"] == context:
                label = f"{report['model']} {run_label(r)}"
                curves.setdefault(label, {})[r["batch"]] = r["speedup"][accelerator][str(tau)]
    return curves


def step_curves(step_files: list[Path], tau: float) -> tuple[Curves, list[str]]:
    """({"<model> <method>@<tree>": {batch: tau / measured step ratio}}, the devices they ran on) from step-time
    runs (XLA attention rows; pairs a method could not draft are absent)."""
    curves: Curves = {}
    devices = []
    for path in step_files:
        report = _read_json(path, "step-time report")
        if "rows" not in report or "device" not in report:
            raise BatchSpeedupError(f"{path}: not a step-time report: pass the step_time.json step_time.py wrote")
        devices.append(report["device"])
        for r in report["rows"]:
            if "step_vs_ar" in r and r["attention"] == "xla":
                label = f"{report['model']} {r['method']}@{r['tree']}"
                curves.setdefault(label, {})[r["batch"]] = tau / r["step_vs_ar"]
    return curves, devices


def off_from(curve: dict[int, float]) -> int | None:
    """The smallest batch size at which the speed-up is below 1 (speculation loses), or None."""
    return min((b for b, s in curve.items() if s < 1.0), default=None)


def _cell(speedup: float | None, notes: list[str]) -> str:
    if speedup is None:
        return "-"
    return f"{speedup:.2f}x" + (f" ({', '.join(notes)})" if notes else "")


def table(curves: Curves, taus: Curves | None = None, picks: dict[str, dict[int, str]] | None = None,
          noise: tuple[str, ...] = ()) -> list[str]:
    """Markdown rows: one series per row, one batch size per column (`speed-up (tau)` when taus are given, with
    the tree `auto` picked where `picks` has one); `noise` rows (AR timed again) have no "off from"."""
    batches = sorted({b for curve in curves.values() for b in curve})
    picks = picks or {}
    lines = ["| method | " + " | ".join(f"batch {b}" for b in batches) + " | off from batch |",
             "|---|" + "---|" * len(batches) + "---|"]
    for label, curve in curves.items():
        cells = [_cell(curve.get(b), ([f"{taus[label][b]:.2f}"] if taus and b in curve else [])
                       + ([picks[label][b]] if b in picks.get(label, {}) else [])) for b in batches]
        off = "n/a" if label in noise else (off_from(curve) or "-")
        name = f"{label} (AR timed again: the noise)" if label in noise else label
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {off} |")
    return lines


def plot(measured: Curves, machine: str, predicted: Curves, accelerator: str, tau: float, path: Path,
         stepped: Curves | None = None) -> Path:
    """Measured speed-ups on the left; predicted ones on the right, with those from measured steps (dotted)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    series = [(axes[0], label, curve, "o", "-") for label, curve in measured.items()]
    series += [(axes[1], label, curve, "o", "-") for label, curve in predicted.items()]
    series += [(axes[1], f"{label} (measured steps)", curve, "s", ":") for label, curve in (stepped or {}).items()]
    for ax, label, curve, marker, style in series:
        batches = sorted(curve)
        ax.plot(batches, [curve[b] for b in batches], marker=marker, linestyle=style, label=label)
    for ax, title in ((axes[0], f"measured, {machine}"), (axes[1], f"predicted, {accelerator}, tau {tau:g}"
                                                      + ("; dotted: from measured steps" if stepped else ""))):
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("speed-up over AR")
        ax.set_title(title)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", nargs="+", type=Path, required=True, help="evaluation run directories")
    parser.add_argument("--predicted", nargs="*", type=Path, default=[], help="roofline.json files")
    parser.add_argument("--steps", nargs="*", type=Path, default=[], help="step_time.json files")
    parser.add_argument("--tau", type=float, default=3.0)
    parser.add_argument("--accelerator", default="H100-SXM")
    parser.add_argument("--out", type=Path, default=Path("runs/benchmarks"))
    args = parser.parse_args()
    try:
        measured = measured_curves(args.measured)
        predicted = predicted_curves(args.predicted, args.accelerator, args.tau)
        stepped, devices = step_curves(args.steps, args.tau)
    except BatchSpeedupError as e:
        raise SystemExit(f"error: {e}") from None
    speedup, settings = measured.speedup, measured.settings
    machine = f"{Path(settings['model']).name} on {settings['backend']}, T={settings['temperature']:g}"
    lines = [f"**Measured** speed-up over AR against batch size: {machine}, {settings['max_new_tokens']} new "
             "tokens; each column is one evaluation run (" + ", ".join(str(p) for p in args.measured) + "). In "
             "brackets: tau and, for `auto`, the tree it picked at that batch size on that machine (AR: none, no "
             "speculation).", "", *table(speedup, measured.tau, measured.picks, measured.noise)]
    if predicted:
        lines += ["", f"**Predicted** (roofline, not measured) speed-up over AR at tau {args.tau:g} on "
                  f"{args.accelerator} against batch size (" + ", ".join(str(p) for p in args.predicted) + ").",
                  "", *table(predicted)]
    if stepped:
        lines += ["", f"**From measured steps** on {', '.join(sorted(set(devices)))}: speed-up over AR at an assumed "
                  f"tau {args.tau:g} = tau / (measured step / AR step) ("
                  + ", ".join(str(p) for p in args.steps) + ").",
                  "", *table(stepped)]
    args.out.mkdir(parents=True, exist_ok=True)
    png = plot(speedup, machine, predicted, args.accelerator, args.tau, args.out / "batch_speedup.png", stepped)
    lines += ["", f"![speed-up against batch size]({png.name})"]
    write_report(args.out, "batch_speedup", {
        "measured": {"settings": settings, "runs": [str(p) for p in args.measured],
                     "speedup": speedup, "tau": measured.tau, "auto_picks": measured.picks,
                     "ar_timed_again": measured.noise,
                     "off_from": {k: off_from(v) for k, v in speedup.items() if k not in measured.noise}},
        "predicted": {"accelerator": args.accelerator, "tau": args.tau, "runs": [str(p) for p in args.predicted],
                      "speedup": predicted, "off_from": {k: off_from(v) for k, v in predicted.items()}},
        "from_steps": {"devices": devices, "tau": args.tau, "runs": [str(p) for p in args.steps],
                       "speedup": stepped, "off_from": {k: off_from(v) for k, v in stepped.items()}},
    }, "\n".join(lines))


if __name__ == "__main__":
    main()
