"""The linear layers of the target and the drafters, with logical axis names on their params.

Two orientations of one map: `logical_dense` (an `nn.Dense`, `kernel [in, out]`: training's stacked target and every
drafter layer) and `OutMajorDense` (`weight [out, in]`, Hugging Face's orientation: decoding's `split_layers` layout),
applied by `rows_product`, which reads the weight once for a step's few rows. `target_projection` builds the
target's projections in either one.

An out-major projection may hold its weight as int8 with a scale per output row (`weight` int8 `[out, in]`,
`weight_scale [out]`: `int8_rows`, `int8_projections`), a quarter of the bytes a product reads; a drafter's decode
params only (a draft's weights change which tokens it proposes, never what the target accepts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from amphista_jax.infra.home import amphista_home
from pallas_kernels.int8_rows import int8_rows_product, load_cpu_kernel

Dtype = Any


def logical_dense(features: int, axes: tuple[str | None, str | None], name: str,
                  kernel_init: Callable = nn.linear.default_kernel_init, use_bias: bool = True,
                  param_dtype: Dtype = jnp.float32) -> nn.Dense:
    """An `nn.Dense` whose kernel `[in, out]` has logical `axes` (its bias: `axes[1]`); the drafters' layers use
    it too, so that their params shard like the target's."""
    return nn.Dense(
        features,
        use_bias=use_bias,
        kernel_init=nn.with_logical_partitioning(kernel_init, axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]),
        param_dtype=param_dtype,
        name=name,
    )


# The most rows `rows_product` multiplies with the weight as the left operand (a decode or verify step's); more rows
# (a prefill's, a training batch's, a batch-64 decode step's) take the plain product. Where the two cross on XLA:CPU
# is measured by `evals/benchmarks/query_rows.py` (docs/results, "A verify forward's cost at T rows").
FEW_ROWS = 32


def rows_product(weight: jax.Array, x: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """`x [..., in] @ weight.T` for an out-major `weight [out, in]`, as `[..., out]`; with `scale [out]`, of the
    int8 `weight` times its row scales (`int8_rows`).

    For a few rows the product is formed as `weight @ x.T` `[out, rows]` and transposed after: XLA:CPU then reads
    the weight once for all the rows, where `x @ kernel` over `[in, out]` kernels reads it at 8-16 GB/s from 2 rows
    on against 28 GB/s for one (`evals/benchmarks/query_rows.py`). The barrier keeps XLA from folding the
    transpose back into the product. An int8 weight's few-row product is `pallas_kernels.int8_rows`'s: its CPU
    kernel where `int8_kernel` has one, else one fused multiply and sum over `in` (a `dot` would first write a
    widened fp32 copy of the weight)."""
    dtype = jnp.result_type(x, jnp.float32 if scale is not None else weight)
    x = x.astype(dtype)
    rows = math.prod(x.shape[:-1])
    if rows > FEW_ROWS:
        y = x @ weight.astype(dtype).T
    elif scale is not None:  # one pass over the int8 weight where it lies (a dot widens a copy)
        weight, x = jax.lax.optimization_barrier((weight, x))  # a loop's step widens no invariant copy before it
        y = int8_rows_product(weight, x.reshape(rows, x.shape[-1]), scale, int8_kernel())
        return y.reshape(*x.shape[:-1], weight.shape[0])
    else:
        y = jax.lax.dot_general(weight.astype(dtype), x.reshape(rows, x.shape[-1]), (((1,), (1,)), ((), ())))
        y = jax.lax.optimization_barrier(y).T.reshape(*x.shape[:-1], weight.shape[0])  # from [out, rows]
    return y if scale is None else y * scale.astype(dtype)


def int8_kernel() -> Path | None:
    """The CPU kernel of int8 weights' few-row products (`pallas_kernels/int8_rows.py`, compiled once per machine
    under `AMPHISTA_HOME/kernels`) where the default backend is the CPU and it builds here; None elsewhere (the
    products then take XLA's fused pass)."""
    return load_cpu_kernel(amphista_home() / "kernels") if jax.default_backend() == "cpu" else None


def int8_rows(weight: jax.Array) -> dict[str, jax.Array]:
    """An out-major `weight [out, in]` as int8 with one symmetric scale per output row: `{"weight": int8 [out, in],
    "weight_scale": [out]}` (fp32), each row's largest magnitude at 127. Cutting rows of both cuts the quantized
    rows."""
    weight = weight.astype(jnp.float32)
    scale = jnp.max(jnp.abs(weight), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    return {"weight": jnp.round(weight / safe[:, None]).astype(jnp.int8), "weight_scale": scale}


def int8_projections(tree: dict) -> dict:
    """`tree` with every out-major projection (a dict holding a 2-D float `weight`) as `int8_rows`, its other
    entries (a bias) kept; projections already int8 are kept as they are."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            value = int8_projections(value)
        elif key == "weight" and value.ndim == 2 and value.dtype != jnp.int8:
            out |= int8_rows(value)
            continue
        out[key] = value
    return out


class OutMajorDense(nn.Module):
    """A target projection in decoding's layout: `weight [out, in]` (Hugging Face's orientation) applied by
    `rows_product`, and `bias [out]`; the same map as an `nn.Dense` whose kernel is `weight.T`."""

    features: int
    axes: tuple[str | None, str | None]  # the [in, out] logical axes, as `logical_dense`'s
    use_bias: bool
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.with_logical_partitioning(nn.initializers.normal(0.02), self.axes[::-1]),
                            (self.features, x.shape[-1]), self.param_dtype)
        scale = self.get_variable("params", "weight_scale") if weight.dtype == jnp.int8 else None
        y = rows_product(weight, x, scale)
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), self.axes[1:]),
                              (self.features,), self.param_dtype)
            y = y + bias.astype(y.dtype)
        return y


def target_projection(features: int, axes: tuple[str, str], use_bias: bool, name: str, param_dtype: Dtype,
                      out_major: bool = False) -> nn.Module:
    """The target's projections (normal(0.02) init): `kernel [in, out]`, or `weight [out, in]` (`out_major`)."""
    if out_major:
        return OutMajorDense(features, axes, use_bias, param_dtype, name=name)
    return logical_dense(features, axes, name, nn.initializers.normal(0.02), use_bias, param_dtype)
