"""Where a verify forward's extra cost over an AR step goes: the target at T query rows, and its weights' products.

    python -m amphista_jax.evals.benchmarks.query_rows [--model DIR | smollm2] [--rows 1 2 3 5 8] [--committed 256]
        [--weights float32 | int8] [--runs 30] [--out runs/benchmarks]

The target is `--model` (default: the embedded one). Part 1: one cached forward of the target (decoding's `split`
layout, fp32) over T new tokens under a causal mask after `--committed` tokens, timed whole (logits included) and
without the output projection (`return_logits=False`); their difference is the output projection over T rows. T = 1
is an AR step's forward, T = N + 1 a verify forward of an N-node tree. Part 2: the matrix products that read the MLP
weights of every layer (`gate_proj`, `up_proj`, `down_proj`) at T rows, all in one program, so the weights stream
from memory as in a forward: as decoding forms them (`projections.rows_product` over the out-major `[F, D]` weights the
target holds) and as `[T, D] @ [D, F]` over the `[in, out]` kernels (their transposed copies, training's layout):
the rate at which T rows read them beside one row's. `--weights int8` holds every projection as a draft model's
`weights="int8"` does (`projections.int8_projections`: int8, a scale per output row; the embedding stays fp32), so
decoding's products are the int8 ones (on the CPU, `pallas_kernels/int8_rows.cc`'s kernel) and the plain ones
widen the transposed int8 copies in XLA's product.
Each time is the fastest of `--runs` calls after a warm-up (noise on a shared machine only adds time). Writes
query_rows.json and query_rows.md to `--out`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from amphista_jax.engine.decode import ar_init
from amphista_jax.evals.benchmarks.common import benchmark_parser, load_target, write_report
from amphista_jax.infra.timing import wall_times
from amphista_jax.models.attention import causal_mask
from amphista_jax.models.llama import target_model
from amphista_jax.models.projections import int8_projections, rows_product
from amphista_jax.models.target import forward

MLP_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def fastest_ms(fn: Callable[[], Any], runs: int) -> float:
    """Milliseconds of the fastest of `runs` calls of `fn` after one warm-up call."""
    return min(wall_times(fn, runs)) * 1e3


def mlp_weights(params: dict) -> list[tuple[jax.Array, jax.Array | None]]:
    """Every layer's out-major MLP weights (`[out, in]`, decoding's `split_layers` layout) with their row scales where
    they are int8 (else None), in the params' key order."""
    found = []

    def visit(node: Any, names: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            if "weight" in node and any(n in MLP_WEIGHTS for n in names):
                found.append((node["weight"], node.get("weight_scale")))
                return
            for key in sorted(node):
                visit(node[key], (*names, key))

    visit(params, ())
    return found


def committed_cache(params: dict, config: Any, committed: int, room: int) -> Any:
    """The target's cache after a prefill of `committed` random tokens, with `room` free slots after them."""
    model = target_model(config, params)
    prompt = jax.random.randint(jax.random.key(2), (1, committed), 0, config.vocab_size)
    init = jax.jit(functools.partial(ar_init, model, cache_size=committed + room, max_new_tokens=room))
    return init(params, prompt, jnp.full((1,), committed, jnp.int32), jax.random.key(0)).cache


def forward_ms(params: dict, config: Any, cache: Any, rows: int, runs: int) -> tuple[float, float]:
    """(whole forward ms, forward without the output projection ms) of verification's forward over `rows` new
    tokens after the cache's committed ones."""
    model = target_model(config, params)
    tokens = jnp.ones((1, rows), jnp.int32)
    positions = cache.lengths[:, None] + jnp.arange(rows)[None]
    mask = causal_mask(1, rows)
    out = {}
    for logits in (True, False):
        def run(p: dict, c: Any, lg: bool = logits) -> jax.Array:
            o = forward(model, p, tokens, positions, c, mask, None, return_logits=lg)
            return o.logits if lg else o.hidden

        out[logits] = fastest_ms(functools.partial(jax.jit(run), params, cache), runs)
    return out[True], out[False]


def products_ms(weights: list[tuple[jax.Array, jax.Array | None]], rows: int, runs: int, out_major: bool) -> float:
    """Milliseconds of `[rows, in]` times every weight `[out, in]` (times its row scales where int8): by
    `rows_product` (`out_major`) or as `[rows, in] @ [in, out]` over a transposed copy (made before timing)."""
    xs = [jnp.ones((rows, w.shape[1]), jnp.float32) for w, _ in weights]
    if out_major:
        fn = jax.jit(lambda ws, xs: [rows_product(w, x, s) for x, (w, s) in zip(xs, ws, strict=True)])
    else:
        weights = [(jnp.array(w.T), s) for w, s in weights]  # [in, out], laid out as such
        fn = jax.jit(lambda ws, xs: [x @ w.astype(jnp.float32) * (1.0 if s is None else s)
                                     for x, (w, s) in zip(xs, ws, strict=True)])
    return fastest_ms(lambda: fn(weights, xs), runs)


def main() -> None:
    parser = benchmark_parser(__doc__, runs=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8])
    parser.add_argument("--committed", type=int, default=256)
    parser.add_argument("--weights", choices=("float32", "int8"), default="float32")
    args = parser.parse_args()
    model, params, config = load_target(args.model)
    if args.weights == "int8":
        params = jax.jit(int8_projections)(params)
    weights = mlp_weights(params)
    if not weights:
        parser.error(f"{model} has no {'/'.join(MLP_WEIGHTS)} weights to time")
    mb = sum(w.size * w.dtype.itemsize for w, _ in weights) / 1e6
    counts = sorted(set(args.rows) | {1})
    cache = committed_cache(params, config, args.committed, counts[-1])  # one attention span for every count
    rows = []
    for t in counts:
        whole, layers = forward_ms(params, config, cache, t, args.runs)
        rows.append({"rows": t, "forward_ms": whole, "layers_ms": layers, "output_projection_ms": whole - layers,
                     "mlp_products_ms": products_ms(weights, t, args.runs, out_major=True),
                     "mlp_in_out_products_ms": products_ms(weights, t, args.runs, out_major=False)})
    one = rows[0]
    lines = [f"model: {model}; {args.committed} committed tokens; {args.weights} projections, batch 1; fastest of "
             f"{args.runs} calls; MLP "
             f"weights: {len(weights)} matrices, {mb:.0f} MB", "",
             "| query rows T | forward ms | / T=1 | layers ms | output projection ms | MLP products ms | / T=1 | "
             "MLP weights read GB/s | `[T, D] @ [D, F]` ms | / T=1 | GB/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mlp, plain = r["mlp_products_ms"], r["mlp_in_out_products_ms"]
        lines.append(f"| {r['rows']} | {r['forward_ms']:.2f} | {r['forward_ms'] / one['forward_ms']:.2f} | "
                     f"{r['layers_ms']:.2f} | {r['output_projection_ms']:.2f} | {mlp:.2f} | "
                     f"{mlp / one['mlp_products_ms']:.2f} | {mb / mlp:.1f} | {plain:.2f} | "
                     f"{plain / one['mlp_in_out_products_ms']:.2f} | {mb / plain:.1f} |")
    write_report(args.out, "query_rows", {"model": model, "committed": args.committed, "weights": args.weights,
                                          "runs": args.runs,
                                          "mlp_weight_mb": mb, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
