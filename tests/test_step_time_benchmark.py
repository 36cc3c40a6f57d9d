"""The step-time benchmark (`evals/benchmarks/step_time.py`): a known shape with random weights (what a GPU times
with nothing to load), several batch sizes, one AR step per batch size, and the (method, tree) pairs a method
cannot draft listed as skipped rather than failing the run."""

from __future__ import annotations

import json
import sys

import pytest

from amphista_jax.evals.benchmarks import step_time


def run(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["step_time", *args])
    step_time.main()


def test_random_target_rows_per_batch_with_skipped_pairs(monkeypatch, tmp_path):
    run(monkeypatch, "--target", "tiny", "--context", "20", "--methods", "medusa", "--trees", "chain-2", "dynamic",
        "--batch", "1", "2", "--layout", "stacked", "--dtype", "bfloat16", "--runs", "1", "--new-tokens", "6",
        "--out", str(tmp_path))
    report = json.loads((tmp_path / "step_time.json").read_text())
    assert (report["model"], report["dtype"], report["layout"], report["context"]) == ("tiny", "bfloat16",
                                                                                        "stacked", 20)
    rows = {(r["batch"], r["tree"]): r for r in report["rows"]}
    assert set(rows) == {(1, "chain-2"), (1, "dynamic"), (2, "chain-2"), (2, "dynamic")}
    for batch in (1, 2):
        timed, skipped = rows[batch, "chain-2"], rows[batch, "dynamic"]
        assert timed["step_ms"] > 0 and timed["ar_step_ms"] > 0
        assert timed["step_vs_ar"] == pytest.approx(timed["step_ms"] / timed["ar_step_ms"])
        assert "static tree" in skipped["skipped"] and "step_ms" not in skipped
    assert "skipped (it cannot draft this tree)" in (tmp_path / "step_time.md").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--target", "tiny", "--model", "tiny", "--context", "8"], "exclude each other"),
    (["--target", "tiny"], "give the prompt's length with --context N"),
    (["--batch", "0"], "--batch sizes must be >= 1")])
def test_bad_arguments_are_one_line(monkeypatch, capsys, args: list[str], message: str):
    with pytest.raises(SystemExit):
        run(monkeypatch, *args)
    assert message in capsys.readouterr().err
