"""The Pallas tree-attention kernel against the XLA path (the model's dense attention), one layer's call.

    python -m amphista_jax.evals.benchmarks.tree_attention_kernel [--nodes 64] [--context 4096] [--batch 1 4]
        [--q-heads 32] [--kv-heads 32] [--head-dim 128] [--k-splits auto 1] [--runs 20] [--out runs/benchmarks]

Random bf16 queries and caches at a Vicuna-7B layer's shape by default: `--nodes` tree nodes (a random tree)
after `--context` committed tokens, the cache exactly `context + nodes` slots long. Each row is the median time
of one jitted call (after a warm-up) of the XLA reference and of the kernel with `--k-splits` splits of the
cache ("auto": `KernelSettings`' GPU choice), and their ratio; the two outputs are also compared. Measured on
a GPU or TPU. On a CPU the kernel only runs interpreted, which measures the interpreter, not the kernel: there
the script refuses unless `--interpret` is given, and then labels every row as a correctness smoke run.
Writes tree_attention_kernel.json and .md to `--out`.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.evals.benchmarks.common import benchmark_parser, median_seconds, write_report
from pallas_kernels.kernel_settings import KernelSettings
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference


def random_inputs(batch: int, nodes: int, context: int, q_heads: int, kv_heads: int, head_dim: int,
                  seed: int = 0) -> dict:
    """Kernel inputs: bf16 q and caches, a random tree of `nodes` nodes after `context` committed tokens."""
    rng = np.random.default_rng(seed)
    parent = [-1] + [int(rng.integers(0, j)) for j in range(1, nodes)]
    mask, depth = np.eye(nodes, dtype=bool), np.zeros(nodes, np.int32)
    for node in range(1, nodes):
        mask[node] |= mask[parent[node]]
        depth[node] = depth[parent[node]] + 1
    keys = jax.random.split(jax.random.key(seed), 3)
    cache = (batch, context + nodes, kv_heads, head_dim)
    return dict(
        q=jax.random.normal(keys[0], (batch, nodes, q_heads, head_dim), jnp.bfloat16),
        k_cache=jax.random.normal(keys[1], cache, jnp.bfloat16),
        v_cache=jax.random.normal(keys[2], cache, jnp.bfloat16),
        lengths=jnp.full((batch,), context, jnp.int32),
        tree_mask=jnp.broadcast_to(jnp.asarray(mask), (batch, nodes, nodes)),
        q_positions=jnp.broadcast_to(jnp.asarray(context + depth), (batch, nodes)),
    )


def bench_row(inputs: dict, settings: KernelSettings, runs: int, interpret: bool) -> dict:
    """Median seconds of the XLA path and of the kernel on `inputs`, their ratio and largest difference."""
    xla = jax.jit(tree_attention_reference)
    kernel = jax.jit(lambda x: tree_attention(**x, settings=settings, backend="pallas", interpret=interpret))
    xla_s = median_seconds(lambda: xla(**inputs), runs)
    kernel_s = median_seconds(lambda: kernel(inputs), runs)
    diff = jnp.max(jnp.abs(kernel(inputs).astype(jnp.float32) - xla(**inputs).astype(jnp.float32)))
    return dict(xla_ms=1e3 * xla_s, pallas_ms=1e3 * kernel_s, speedup=xla_s / kernel_s, max_abs_diff=float(diff))


def table(rows: list[dict], device: str, interpret: bool) -> str:
    title = ("**Interpret mode on CPU: a correctness smoke run, not a speed measurement.**" if interpret else
             f"Measured on {device}.")
    lines = [title, "", "| batch | nodes | context | k_splits | XLA ms | Pallas ms | XLA / Pallas | max abs diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['nodes']} | {r['context']} | {r['k_splits']} | {r['xla_ms']:.3f} | "
                     f"{r['pallas_ms']:.3f} | {r['speedup']:.2f}x | {r['max_abs_diff']:.3g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, runs=20)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--context", type=int, nargs="+", default=[4096])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--k-splits", nargs="+", default=["auto", "1"])
    parser.add_argument("--interpret", action="store_true", help="allow the interpreted kernel on CPU (smoke)")
    args = parser.parse_args(argv)
    if jax.default_backend() == "cpu" and not args.interpret:
        sys.exit("tree_attention_kernel: on CPU the kernel only runs interpreted, which times the interpreter; "
                 "run on a GPU or TPU, or pass --interpret for a correctness smoke run")
    try:
        settings = [KernelSettings(k_splits=None if s == "auto" else int(s)) for s in args.k_splits]
    except ValueError:
        sys.exit(f"tree_attention_kernel: --k-splits takes 'auto' or positive integers, got {args.k_splits}")
    device = jax.devices()[0].device_kind
    rows = []
    for batch in args.batch:
        for context in args.context:
            inputs = random_inputs(batch, args.nodes, context, args.q_heads, args.kv_heads, args.head_dim)
            for setting in settings:
                row = bench_row(inputs, setting, args.runs, args.interpret)
                rows.append(dict(batch=batch, nodes=args.nodes, context=context,
                                 k_splits=setting.k_splits or "auto", **row))
    write_report(args.out, "tree_attention_kernel", dict(device=device, interpret=args.interpret, rows=rows),
                 table(rows, device, args.interpret))


if __name__ == "__main__":
    main()
