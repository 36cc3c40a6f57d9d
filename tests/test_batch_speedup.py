"""The speed-up-against-batch benchmark: it reads evaluation runs (one batch size each) and roofline runs, finds
where speculation stops paying, and refuses runs that cannot be compared."""

from __future__ import annotations

import json
import sys

import pytest

from amphista_jax.evals.benchmarks import batch_speedup
from amphista_jax.evals.benchmarks.batch_speedup import BatchSpeedupError, measured_curves, off_from, predicted_curves


def _eval_run(root, batch: int, speedups: dict[str, float], temperature: float = 0.0,
              trees: dict[str, tuple[str, str, int]] | None = None):
    """An evaluation run's summary at `batch`; `trees`: label -> (method, tree name, tree nodes with the root), for
    labels other than a method on small-8."""
    run = root / f"b{batch}-t{temperature}"
    run.mkdir(parents=True)
    metrics = {"ar": {"overall": {"speedup": 1.0, "tau": 1.0}}} | {
        label: {"overall": {"speedup": s, "tau": 1.5}} for label, s in speedups.items()}
    methods = [{"label": "ar", "method": "ar", "tree": "-", "tree_nodes": 0}] + [
        dict(zip(("method", "tree", "tree_nodes"), (trees or {}).get(label, ("medusa", "small-8", 9)), strict=True),
             label=label) for label in speedups]
    (run / "summary.json").write_text(json.dumps({
        "model": "smollm2", "backend": "cpu", "metrics": metrics, "methods": methods,
        "config": {"batch_size": batch, "temperature": temperature, "max_new_tokens": 64}}))
    return run


def _roofline(path, speedups: dict[int, float]):
    rows = [{"batch": b, "context": 512, "method": "ar", "tree": "-"} for b in speedups]
    rows += [{"batch": b, "context": c, "method": "eagle3", "tree": "chain-3",
              "speedup": {"H100-SXM": {"3.0": s if c == 512 else 99.0}}}
             for b, s in speedups.items() for c in (512, 2048)]
    path.write_text(json.dumps({"model": "vicuna-7b", "rows": rows}))
    return path


def test_curves_and_where_speculation_switches_off(tmp_path):
    runs = [_eval_run(tmp_path, 1, {"eagle": 1.2, "lookup": 1.1}),
            _eval_run(tmp_path, 4, {"eagle": 0.9, "lookup": 1.05}),
            _eval_run(tmp_path, 16, {"eagle": 1.1, "lookup": 1.01})]
    measured = measured_curves(runs)
    speedup = measured.speedup
    assert speedup == {"eagle": {1: 1.2, 4: 0.9, 16: 1.1}, "lookup": {1: 1.1, 4: 1.05, 16: 1.01}}
    assert measured.tau["eagle"][4] == 1.5 and measured.settings["model"] == "smollm2"
    assert off_from(speedup["eagle"]) == 4 and off_from(speedup["lookup"]) is None  # the first batch it loses at
    predicted = predicted_curves([_roofline(tmp_path / "r.json", {1: 2.5, 16: 1.4, 64: 0.8})], "H100-SXM", 3.0)
    assert predicted == {"vicuna-7b eagle3@chain-3": {1: 2.5, 16: 1.4, 64: 0.8}}  # the smallest context only


def test_runs_that_cannot_be_compared_are_refused(tmp_path):
    with pytest.raises(BatchSpeedupError, match="differs from the first run"):
        measured_curves([_eval_run(tmp_path, 1, {"eagle": 1.2}), _eval_run(tmp_path, 4, {"eagle": 1.0}, 1.0)])
    with pytest.raises(BatchSpeedupError, match="a second run at batch size 1"):
        measured_curves([_eval_run(tmp_path / "a", 1, {"eagle": 1.2}), _eval_run(tmp_path / "b", 1, {"eagle": 1.0})])
    with pytest.raises(BatchSpeedupError, match="no speed-up at tau 2.0 on H100-SXM"):
        predicted_curves([_roofline(tmp_path / "r.json", {1: 2.5})], "H100-SXM", 2.0)
    with pytest.raises(BatchSpeedupError, match="not a readable evaluation summary"):
        measured_curves([tmp_path / "nothing"])


def test_main_writes_the_table_json_and_plot(tmp_path, monkeypatch):
    runs = [_eval_run(tmp_path, 1, {"eagle": 1.2}), _eval_run(tmp_path, 4, {"eagle": 0.9})]
    roof = _roofline(tmp_path / "r.json", {1: 2.5, 64: 0.8})
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["batch_speedup", "--measured", *map(str, runs), "--predicted", str(roof),
                                      "--out", str(out)])
    batch_speedup.main()
    data = json.loads((out / "batch_speedup.json").read_text())
    assert data["measured"]["off_from"] == {"eagle": 4} and data["predicted"]["off_from"] == {
        "vicuna-7b eagle3@chain-3": 64}
    table = (out / "batch_speedup.md").read_text()
    assert "| eagle | 1.20x (1.50) | 0.90x (1.50) | 4 |" in table
    assert "| vicuna-7b eagle3@chain-3 | 2.50x | 0.80x | 64 |" in table
    assert (out / "batch_speedup.png").stat().st_size > 0


def test_auto_picks_and_ar_timed_again(tmp_path, monkeypatch):
    """`auto` shows the tree it picked at each batch size (AR where none); AR timed again is the runs' noise:
    shown, never "off"."""
    auto = {1: ("eagle3", "auto", 5), 4: ("eagle3", "auto: none at batch 4", 0)}
    runs = [_eval_run(tmp_path, b, {"e3-auto": s, "ar-end": n}, trees={"e3-auto": auto[b], "ar-end": ("ar", "-", 0)})
            for b, s, n in ((1, 1.07, 1.02), (4, 0.99, 0.97))]
    measured = measured_curves(runs)
    assert measured.picks == {"e3-auto": {1: "4 nodes", 4: "AR"}} and measured.noise == ("ar-end",)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["batch_speedup", "--measured", *map(str, runs), "--out", str(out)])
    batch_speedup.main()
    table = (out / "batch_speedup.md").read_text()
    assert "| e3-auto | 1.07x (1.50, 4 nodes) | 0.99x (1.50, AR) | 4 |" in table
    assert "| ar-end (AR timed again: the noise) | 1.02x (1.50) | 0.97x (1.50) | n/a |" in table
    assert json.loads((out / "batch_speedup.json").read_text())["measured"]["off_from"] == {"e3-auto": 4}


def test_speed_ups_from_measured_steps(tmp_path, monkeypatch):
    """A step-time run (e.g. a GPU's) gives tau / (step / AR step) per batch; skipped pairs and Pallas rows are left
    out; main adds the table and the JSON section."""
    rows = [{"batch": b, "attention": "xla", "method": "eagle3", "tree": "chain-3", "step_vs_ar": r}
            for b, r in ((1, 1.5), (16, 4.0))]
    rows += [{"batch": 1, "attention": "pallas", "method": "eagle3", "tree": "chain-3", "step_vs_ar": 9.0},
             {"batch": 1, "attention": "xla", "method": "medusa", "tree": "dynamic", "skipped": "static trees only"}]
    steps = tmp_path / "step_time.json"
    steps.write_text(json.dumps({"model": "llama-3-8b", "device": "NVIDIA H200", "rows": rows}))
    curves, devices = batch_speedup.step_curves([steps], 3.0)
    assert curves == {"llama-3-8b eagle3@chain-3": {1: 2.0, 16: 0.75}} and devices == ["NVIDIA H200"]
    with pytest.raises(BatchSpeedupError, match="not a step-time report"):
        batch_speedup.step_curves([_roofline(tmp_path / "r.json", {1: 2.5})], 3.0)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["batch_speedup", "--measured", str(_eval_run(tmp_path, 1, {"eagle": 1.2})),
                                      "--steps", str(steps), "--out", str(out)])
    batch_speedup.main()
    data = json.loads((out / "batch_speedup.json").read_text())
    assert data["from_steps"]["off_from"] == {"llama-3-8b eagle3@chain-3": 16}
    assert "| llama-3-8b eagle3@chain-3 | 2.00x | 0.75x | 16 |" in (out / "batch_speedup.md").read_text()
