"""The step-time benchmark (`evals/benchmarks/step_time.py`): a known shape with random weights (what a GPU times
with nothing to load), several batch sizes, one AR step per batch size, and the (method, tree) pairs a method
cannot draft listed as skipped rather than failing the run. The clock's decodes are replaced by a deterministic
one (a loaded machine's timing noise is not this file's subject; tree search's tests time real decodes)."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import pytest

from amphista_jax.evals.benchmarks import step_time
from amphista_jax.tree_search import StepClock


def run(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["step_time", *args])
    step_time.main()


def test_random_target_rows_per_batch_with_skipped_pairs(monkeypatch, tmp_path):
    decoded = []

    def timed_runs(self, gen, new_tokens: int) -> tuple[list[float], int]:
        """1 ms a step for AR and 3 ms for a drafter, plus 10 ms of prefill; one step per token."""
        decoded.append((self.tokens.shape[0], gen.drafter is None, jax.tree.leaves(gen.params)[0].dtype,
                        {x.dtype for x in jax.tree.leaves(gen.draft_params) if jnp.issubdtype(x.dtype, jnp.floating)}))
        return [0.010 + new_tokens * (0.001 if gen.drafter is None else 0.003)], new_tokens

    monkeypatch.setattr(StepClock, "timed_runs", timed_runs)
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
        # (decode of 6 tokens - decode of 1) / 6 steps
        assert timed["step_ms"] == pytest.approx(3.0 * 5 / 6) and timed["ar_step_ms"] == pytest.approx(5 / 6)
        assert timed["step_vs_ar"] == pytest.approx(3.0)
        assert "static tree" in skipped["skipped"] and "step_ms" not in skipped
    assert "skipped (it cannot draft this tree)" in (tmp_path / "step_time.md").read_text()
    # per batch: AR with and without tokens, the drafter's prefill and its one drawable tree; all in bf16
    assert [(b, ar) for b, ar, *_ in decoded] == [(b, ar) for b in (1, 2) for ar in (True, True, False, False)]
    assert all(dtype == jnp.bfloat16 for _, _, dtype, _ in decoded)
    assert all(drafts == {jnp.dtype(jnp.bfloat16)} for _, ar, _, drafts in decoded if not ar)


@pytest.mark.parametrize(("args", "message"), [
    (["--target", "tiny", "--model", "tiny", "--context", "8"], "exclude each other"),
    (["--target", "tiny"], "give the prompt's length with --context N"),
    (["--batch", "0"], "--batch sizes must be >= 1")])
def test_bad_arguments_are_one_line(monkeypatch, capsys, args: list[str], message: str):
    with pytest.raises(SystemExit):
        run(monkeypatch, *args)
    assert message in capsys.readouterr().err
