"""Whether narrower weights read faster here: one matrix product `[T, D] @ [D, V]` in jit per weight dtype.

    python -m amphista_jax.evals.benchmarks.weight_dtypes [--shape 896 151936] [--rows 1 8] [--runs 20]
        [--out runs/benchmarks]

A decoding step at batch 1 reads its weights once per token, so it is as fast as they stream from memory; halving
their bytes (bf16, f16) or quartering them (int8) pays only where the compiled product still streams them at the
same rate. Each row times the product with the weights held as one dtype: fp32; bf16 (activations cast to bf16, fp32
accumulation); f16 and int8 converted to fp32 inside the product (weight-only quantisation, as XLA fuses it); int8
activations times int8 weights into int32; and decoding's own products (`projections.rows_product` over out-major
`[V, D]` weights): fp32, and int8 with a scale per row (`projections.int8_rows`, a drafter's `weights="int8"`: on the
CPU `pallas_kernels/int8_rows.cc`'s kernel), beside the kernel's reference (XLA's fused multiply-and-sum over the int8
bytes). The default shape is Qwen2.5-Coder-0.5B's output projection (896 x
151,936, 545 MB in fp32). Each time is the fastest of `--runs` calls after a warm-up; GB/s is the weights' bytes
over it. Writes weight_dtypes.json and weight_dtypes.md to `--out`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from amphista_jax.evals.benchmarks.common import benchmark_parser, write_report
from amphista_jax.infra.timing import wall_times
from amphista_jax.models.projections import rows_product
from pallas_kernels.int8_rows import int8_rows_reference

# name -> (the weights' dtype, the product over activations x [T, D] and weights w [D, V], or w [V, D] for the names
# in OUT_MAJOR)
PRODUCTS: dict[str, tuple[DTypeLike, Callable[[jax.Array, jax.Array], jax.Array]]] = {
    "fp32": (jnp.float32, lambda x, w: x @ w),
    "fp32, decoding's rows_product": (jnp.float32, lambda x, w: rows_product(w, x)),
    "int8 rows, decoding's rows_product": (jnp.int8, lambda x, w: rows_product(w, x, jnp.ones(w.shape[0]))),
    "int8 rows, XLA's fused pass": (jnp.int8, lambda x, w: int8_rows_reference(w, x, jnp.ones(w.shape[0]))),
    "bf16": (jnp.bfloat16, lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)),
    "f16 -> fp32 in the product": (jnp.float16, lambda x, w: x @ w.astype(jnp.float32)),
    "int8 -> fp32 in the product": (jnp.int8, lambda x, w: x @ w.astype(jnp.float32)),
    "int8 x int8 -> int32": (jnp.int8, lambda x, w: jnp.dot(x.astype(jnp.int8), w,
                                                            preferred_element_type=jnp.int32)),
}
OUT_MAJOR = ("fp32, decoding's rows_product", "int8 rows, decoding's rows_product", "int8 rows, XLA's fused pass")


def product_ms(name: str, rows: int, shape: tuple[int, int], runs: int) -> float:
    """Milliseconds of the fastest of `runs` calls of product `name` over `rows` activation rows."""
    dtype, product = PRODUCTS[name]
    key = jax.random.PRNGKey(0)
    w = (jax.random.normal(key, shape[::-1] if name in OUT_MAJOR else shape) * (64 if dtype == jnp.int8 else 0.02)
         ).astype(dtype)
    x = jax.random.normal(jax.random.fold_in(key, 1), (rows, shape[0]))
    fn = jax.jit(product)
    return min(wall_times(lambda: fn(x, w), runs)) * 1e3


def main() -> None:
    parser = benchmark_parser(__doc__, runs=20)
    parser.add_argument("--shape", type=int, nargs=2, default=[896, 151936], metavar=("D", "V"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    shape = tuple(args.shape)
    rows = []
    for name, (dtype, _) in PRODUCTS.items():
        mb = shape[0] * shape[1] * jnp.dtype(dtype).itemsize / 1e6
        rows += [{"weights": name, "rows": t, "mb": mb, "ms": product_ms(name, t, shape, args.runs)} for t in args.rows]
    fp32 = {r["rows"]: r["ms"] for r in rows if r["weights"] == "fp32"}
    lines = [f"`[T, D] @ [D, V]`, D x V = {shape[0]} x {shape[1]}, fastest of {args.runs} calls", "",
             "| weights | T | weights MB | ms | GB/s | time / fp32's |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['weights']} | {r['rows']} | {r['mb']:.0f} | {r['ms']:.1f} | {r['mb'] / r['ms']:.1f} | "
              f"{r['ms'] / fp32[r['rows']]:.2f}x |" for r in rows]
    write_report(args.out, "weight_dtypes", {"shape": shape, "runs": args.runs, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
