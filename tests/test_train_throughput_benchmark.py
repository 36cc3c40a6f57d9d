"""The train-step benchmark (`evals/benchmarks/train_throughput.py`): one row per method, each timed on the stored
states and top-k labels a label store gives (the inputs of the layers the method reads among them), over the draft
vocabulary asked for; the recipes' settings where they differ from a method's default."""

from __future__ import annotations

import json
import sys

from amphista_jax.evals.benchmarks import train_throughput


def test_rows_per_method_on_stored_states(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["train_throughput", "--model", "tiny", "--methods", "medusa", "eagle3",
                                      "--batch-size", "2", "--seq-len", "16", "--draft-vocab-size", "64",
                                      "--steps", "1", "--out", str(tmp_path)])
    train_throughput.main()
    report = json.loads((tmp_path / "train_throughput.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["medusa", "eagle3"]
    assert rows["eagle3"]["settings"] == {"ttt_steps": 7} and rows["medusa"]["settings"] == {}
    assert all(r["draft_vocab_size"] == 64 and r["step_s"] > 0 and r["stored_step_s"] > 0 for r in rows.values())
    assert "machine" in report and "| eagle3 |" in (tmp_path / "train_throughput.md").read_text()
