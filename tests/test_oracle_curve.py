"""The oracle-drafter benchmark (`evals/benchmarks/oracle_curve.py`): its drafter's accuracy is what it says, its
outputs equal AR's, and it writes its table, JSON and plot."""

from __future__ import annotations

import json

from amphista_jax.evals.benchmarks import oracle_curve
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.trees.names import PRESETS


def test_oracle_accuracy_sets_tau_and_outputs_equal_ar(tmp_path):
    config = tiny_llama_config(vocab_size=64, num_layers=1, hidden_size=32)
    trees = {"chain-4": PRESETS["chain-4"]}
    rows = oracle_curve.bench("tiny", config, "float32", [0.0, 1.0], trees, new_tokens=21, runs=1, prompt_len=5)
    assert [(r["tree"], r["p_right"]) for r in rows] == [("-", None), ("chain-4", 0.0), ("chain-4", 1.0)]
    assert all(r["same_as_ar"] for r in rows)
    # Always wrong: one token per step; always right: every step accepts the whole chain (20 tokens = 4 x 5).
    assert [r["tau"] for r in rows] == [1.0, 1.0, 5.0]
    oracle_curve.write_report(tmp_path, "oracle_curve", {"rows": rows}, oracle_curve.table(rows))
    oracle_curve.plot(rows, tmp_path / "oracle_curve.png")
    assert json.loads((tmp_path / "oracle_curve.json").read_text())["rows"][2]["tau"] == 5.0
    assert "| tiny |" in (tmp_path / "oracle_curve.md").read_text()
    assert (tmp_path / "oracle_curve.png").stat().st_size > 0
