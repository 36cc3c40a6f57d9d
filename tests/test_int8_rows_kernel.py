"""The CPU kernel of an int8 weight's few-row product (`pallas_kernels/int8_rows.cc`) against its pure-jnp reference:
within the error its int16 activations allow, in jit and in a loop; and its build: once per source and machine, never
read half-written, a failed build a typed error and, through `load_cpu_kernel`, one note and the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.models.projections import int8_rows
from pallas_kernels import int8_rows as kernel_module
from pallas_kernels.int8_rows import (
    KernelBuildError,
    build_cpu_kernel,
    int8_rows_product,
    int8_rows_reference,
    load_cpu_kernel,
)

CHUNK = 256  # the kernel's kChunk: inputs quantized with one step


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    if jax.default_backend() != "cpu":  # products take the reference there: nothing of the kernel's to test
        pytest.skip("the CPU kernel runs on the CPU backend only")
    try:
        return build_cpu_kernel(tmp_path_factory.mktemp("kernels"))
    except KernelBuildError as e:  # a machine without a C++ compiler decodes on the reference; nothing to test
        pytest.skip(f"the CPU kernel cannot be built here: {e}")


def _quantization_bound(weight: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """[rows, out]: how far the kernel may be from the exact product: each activation is rounded to half its chunk's
    int16 step, each chunk's step being its largest magnitude / 32767, plus fp32 rounding of the sums."""
    rows, d = x.shape
    bound = np.zeros((rows, weight.shape[0]))
    for c in range(0, d, CHUNK):
        step = np.abs(x[:, c:c + CHUNK]).max(-1) / 32767  # [rows]
        bound += (step / 2)[:, None] * np.abs(weight[:, c:c + CHUNK]).sum(-1)[None]
    magnitude = np.abs(x) @ np.abs(weight).T
    return (bound + 1e-6 * magnitude) * scale[None]


@pytest.mark.parametrize("rows, out, d", [(1, 517, 896), (1, 61, 1000), (2, 64, 24), (3, 130, 600), (5, 9, 1000),
                                          (8, 256, 64), (17, 33, 300)])
def test_the_kernel_is_its_reference_within_its_activations_rounding(kernel, rows, out, d):
    """Shapes with output rows off its tiles and blocks, inputs off its vectors and chunks, more activation rows than a
    tile: every product within the bound its int16 activations allow of the exact (float64) product, as the
    reference is; a zero weight row gives 0, an activation row of zeros gives 0. The bound steps each chunk of inputs
    by its own largest magnitude, so an outlier (the last row's first input) costs only its own chunk's
    precision."""
    k = jax.random.split(jax.random.key(0), 3)
    q = int8_rows(jax.random.normal(k[0], (out, d)).at[out // 2].set(0.0))
    x = np.array(jax.random.normal(k[1], (rows, d)))
    if rows > 1:
        x[-1, 0] = 1e4  # an outlier, as a real model's activations have (its row's other chunks keep their steps)
        x[0] = 0.0
    weight, scale = np.asarray(q["weight"], np.float64), np.asarray(q["weight_scale"], np.float64)
    exact = (x.astype(np.float64) @ weight.T) * scale[None]
    got = np.asarray(jax.jit(int8_rows_product, static_argnums=3)(q["weight"], jnp.asarray(x), q["weight_scale"],
                                                                  kernel))
    bound = _quantization_bound(weight, scale, x)
    assert np.all(np.abs(got - exact) <= bound), np.max(np.abs(got - exact) - bound)
    np.testing.assert_allclose(np.asarray(int8_rows_reference(q["weight"], jnp.asarray(x), q["weight_scale"])),
                               exact, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(exact))))
    assert np.all(got[:, out // 2] == 0.0)
    if rows > 1:
        assert np.all(got[0] == 0.0)


def test_the_kernel_in_a_loop_is_the_kernel_outside_it(kernel):
    """Called each step of a jitted loop (as decoding calls it), with its weight loop-invariant: the same products,
    bit for bit, as the same calls one by one."""
    q = int8_rows(jax.random.normal(jax.random.key(0), (96, 80)))
    xs = jax.random.normal(jax.random.key(1), (4, 2, 80))

    @jax.jit
    def loop(w, s, xs):
        def body(i, ys):
            return ys.at[i].set(int8_rows_product(w, xs[i], s, kernel))
        return jax.lax.fori_loop(0, xs.shape[0], body, jnp.zeros((xs.shape[0], 2, 96)))

    one_by_one = np.stack([np.asarray(int8_rows_product(q["weight"], x, q["weight_scale"], kernel)) for x in xs])
    np.testing.assert_array_equal(np.asarray(loop(q["weight"], q["weight_scale"], xs)), one_by_one)


def test_the_kernel_is_built_once_and_never_read_half_written(tmp_path, monkeypatch):
    """A second build in the same folder is the first's file, untouched; a compiler that fails leaves a typed error
    naming it and nothing in the folder that a later load would take; `load_cpu_kernel` turns that into one note
    and None (products take the reference)."""
    try:
        library = build_cpu_kernel(tmp_path / "ok")
    except KernelBuildError as e:
        pytest.skip(f"the CPU kernel cannot be built here: {e}")
    stamp = library.stat().st_mtime_ns
    assert build_cpu_kernel(tmp_path / "ok") == library and library.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "ok").iterdir()] == [library.name]

    broken = tmp_path / "cxx"
    broken.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\necho 'error: no' >&2\n"
                      "exit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    with pytest.raises(KernelBuildError, match="failed on int8_rows.cc: error: no"):
        build_cpu_kernel(tmp_path / "bad")
    assert list((tmp_path / "bad").iterdir()) == []
    monkeypatch.setattr(kernel_module, "_compiler", lambda: None)
    with pytest.raises(KernelBuildError, match="no C\\+\\+ compiler"):
        build_cpu_kernel(tmp_path / "none")


def test_a_kernel_that_cannot_be_built_leaves_the_reference(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kernel_module, "_compiler", lambda: None)
    assert load_cpu_kernel(tmp_path / "none") is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C++ compiler" in err and "AMPHISTA_CPU_KERNELS=0" in err
    monkeypatch.setenv("AMPHISTA_CPU_KERNELS", "0")
    assert load_cpu_kernel(tmp_path / "off") is None and capsys.readouterr().err == ""
    q = int8_rows(jax.random.normal(jax.random.key(0), (8, 40)))
    x = jax.random.normal(jax.random.key(1), (2, 40))
    np.testing.assert_array_equal(np.asarray(int8_rows_product(q["weight"], x, q["weight_scale"], None)),
                                  np.asarray(int8_rows_reference(q["weight"], x, q["weight_scale"])))


def test_a_nan_activation_gives_nan_products_as_the_reference_does(kernel):
    """A NaN or infinite activation is not rounded away: every product of its row is NaN (the reference's are NaN or
    infinite); the other rows are untouched."""
    q = int8_rows(jax.random.normal(jax.random.key(0), (12, 40)))
    x = jax.random.normal(jax.random.key(1), (3, 40)).at[1, 7].set(jnp.nan).at[2, 3].set(jnp.inf)
    got = np.asarray(int8_rows_product(q["weight"], x, q["weight_scale"], kernel))
    assert np.all(np.isnan(got[1])) and np.all(np.isnan(got[2]))
    assert not np.any(np.isfinite(np.asarray(int8_rows_reference(q["weight"], x, q["weight_scale"]))[1:]))
    np.testing.assert_allclose(got[0], np.asarray(int8_rows_reference(q["weight"], x, q["weight_scale"]))[0],
                               rtol=1e-3, atol=1e-3)
