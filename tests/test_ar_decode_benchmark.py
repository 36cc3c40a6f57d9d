"""The AR benchmark (`evals/benchmarks/ar_decode.py`) compares like with like: on a real checkpoint (`--model`, here
the embedded one by its registry name) `transformers` and our `generate` load the same files, decode the same
prompts at every batch size, and write the same greedy tokens (EOS is a token like any other on both sides)."""

from __future__ import annotations

from amphista_jax.evals.benchmarks import ar_decode


def test_checkpoint_rows_decode_the_same_tokens_as_transformers_at_each_batch():
    rows = ar_decode.checkpoint_rows("tiny", dtypes=["float32"], batches=[3], layouts=["split"], new_tokens=12,
                                     runs=1, prompt_len=8, bandwidth=1e10)
    assert [(r["model"], r["batch"]) for r in rows] == [("tiny", 3)]
    for r in rows:
        assert r["same_tokens"] is True, r
        assert r["torch_tokens_per_s"] > 0 and r["ours_tokens_per_s"] > 0
        assert r["roofline_tokens_per_s"] == r["batch"] * 1e10 / r["weight_bytes"]
