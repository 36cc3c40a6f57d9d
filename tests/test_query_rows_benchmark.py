"""The query-rows benchmark (`evals/benchmarks/query_rows.py`) on the embedded target: it times what it says (every
layer's three MLP weights; the forward with and without its output projection at each row count, T = 1 always among
them; the products as decoding forms them and as plain `[T, D] @ [D, F]`, the same map) and writes one row per
count. The clock is replaced by a count of the calls it times: a loaded machine's timing noise is not this file's
subject."""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.evals.benchmarks import query_rows
from amphista_jax.evals.benchmarks.common import load_target
from amphista_jax.models.projections import int8_projections


def test_mlp_weights_are_every_layers_three_out_major_weights():
    _, params, config = load_target(None)
    weights = query_rows.mlp_weights(params)
    assert len(weights) == 3 * config.num_layers
    assert {tuple(w.shape) for w, _ in weights} == {(config.hidden_size, config.intermediate_size),
                                                    (config.intermediate_size, config.hidden_size)}
    assert all(s is None for _, s in weights)
    mlps = [params[f"layer_{i}"]["mlp"][name]["weight"] for i in range(config.num_layers)
            for name in query_rows.MLP_WEIGHTS]
    assert {id(w) for w, _ in weights} == {id(w) for w in mlps}  # each layer's own arrays, every one
    int8 = query_rows.mlp_weights(int8_projections(params))
    assert [w.dtype for w, _ in int8] == [jnp.int8] * len(weights) and all(s is not None for _, s in int8)


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_one_row_per_count_with_one_row_added(monkeypatch, tmp_path, weights):
    calls = []

    def fastest_ms(fn, runs: int) -> float:
        out = fn()  # the timed program runs for real
        calls.append(out)
        return float(len(calls))

    monkeypatch.setattr(query_rows, "fastest_ms", fastest_ms)
    monkeypatch.setattr(sys, "argv", ["query_rows", "--rows", "3", "--runs", "1", "--committed", "16",
                                      "--weights", weights, "--out", str(tmp_path)])
    query_rows.main()
    report = json.loads((tmp_path / "query_rows.json").read_text())
    assert [r["rows"] for r in report["rows"]] == [1, 3] and report["weights"] == weights
    # per count: forward with logits, without, then the MLP products by `rows_product` and plainly, in that order
    assert [(r["forward_ms"], r["layers_ms"], r["mlp_products_ms"], r["mlp_in_out_products_ms"])
            for r in report["rows"]] == [(1, 2, 3, 4), (5, 6, 7, 8)]
    assert calls[0].shape[:2] == (1, 1) and calls[4].shape[:2] == (1, 3)  # logits [B, T, V]
    assert calls[4].shape[-1] == load_target(None)[2].vocab_size
    for decoding, plain in ((calls[2], calls[3]), (calls[6], calls[7])):  # the same products, both ways
        assert len(decoding) == len(plain) == 3 * load_target(None)[2].num_layers
        for a, b in zip(decoding, plain, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert (tmp_path / "query_rows.md").read_text().count("\n| ") == 3  # header + two rows
