"""The weight-dtype benchmark (`evals/benchmarks/weight_dtypes.py`): each timed product computes `x @ w` with its
weights held in its dtype, and a run writes a row per dtype and row count."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.evals.benchmarks import weight_dtypes


@pytest.mark.parametrize("name", list(weight_dtypes.PRODUCTS))
def test_each_product_is_the_matrix_product_of_its_weights(name):
    dtype, product = weight_dtypes.PRODUCTS[name]
    w = jax.random.randint(jax.random.PRNGKey(0), (16, 24), -8, 8).astype(dtype)  # exact in every dtype
    x = jax.random.randint(jax.random.PRNGKey(1), (3, 16), -4, 4).astype(jnp.float32)
    expected = np.asarray(x) @ np.asarray(w, np.float32)
    w = w.T if name in weight_dtypes.OUT_MAJOR else w  # decoding's products read out-major [V, D] weights
    # decoding's int8 product runs the CPU kernel, which rounds activations to int16 steps (`pallas_kernels/int8_rows`;
    # its bound: test_int8_rows_kernel.py); every other product is exact on these integers
    atol = 1e-3 * np.max(np.abs(expected)) if name == "int8 rows, decoding's rows_product" else 0
    np.testing.assert_allclose(np.asarray(jax.jit(product)(x, w), np.float32), expected, atol=atol)


def test_a_run_writes_a_row_per_dtype_and_row_count(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["weight_dtypes", "--shape", "32", "64", "--rows", "1", "2", "--runs", "2",
                                      "--out", str(tmp_path)])
    weight_dtypes.main()
    report = json.loads((tmp_path / "weight_dtypes.json").read_text())
    assert [(r["weights"], r["rows"]) for r in report["rows"]] == [(n, t) for n in weight_dtypes.PRODUCTS
                                                                    for t in (1, 2)]
    assert all(r["ms"] > 0 for r in report["rows"]) and report["machine"]["backend"] == "cpu"
    assert "| int8 x int8 -> int32 | 2 |" in (tmp_path / "weight_dtypes.md").read_text()
