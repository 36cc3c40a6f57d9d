"""The evaluation report's reading of a run: AR timed again gives the run's timing noise."""

from __future__ import annotations

import json

from amphista_jax.evals.report import markdown, timing_noise
from tests.helpers import ROOT

RUN = ROOT / "docs/results/history/smollm2/mt-bench-r8-t0.json"  # a real summary, AR timed once


def _with_ar_again(summary: dict, speedups: dict[str, float]) -> dict:
    """`summary` with AR timed again under each label in `speedups`, reading that speed-up."""
    out = json.loads(json.dumps(summary))
    for label, speedup in speedups.items():
        out["methods"].append({"label": label, "spec": f"{label}=ar", "method": "ar", "tree": "-", "tree_nodes": 0,
                               "tree_choices": None, "tree_budget": None, "settings": {}})
        row = dict(out["metrics"]["ar"]["overall"], speedup=speedup)
        out["metrics"][label] = {"overall": row}
        out["compile"][label] = []
    return out


def test_ar_timed_again_reports_the_runs_noise_and_once_reports_none():
    summary = json.loads(RUN.read_text())
    assert timing_noise(summary) is None and "Timing noise" not in markdown(summary)
    noisy = _with_ar_again(summary, {"ar-mid": 0.97, "ar-end": 1.05})
    line = timing_noise(noisy)
    assert line is not None and "`ar-mid` 0.97x, `ar-end` 1.05x" in line and "within 5% of 1.00x" in line
    assert line in markdown(noisy)
