"""Draft overhead per decoding step: the time of each method's `propose` and `commit`, per tree and per depth.

    python -m evals.benchmarks.draft_overhead [--model DIR] [--methods medusa amphista hydra hydra++]
                                              [--trees mc_sim_7b_63 small-16 chain-4] [--batch 1] [--runs 20]
                                              [--out runs/benchmarks]

Hydra's appendix D (Table 1) splits the draft overhead into the prefix attention and each head; here the
same split comes from timing `propose` on the tree cut at depth 1, 2, ..., D: the increments are what each
deeper head adds (for Medusa and Amphista, whose heads all run in one pass, they are ~0 apart from the top-k
gather). `commit` is where the drafters' own causal layers run (Amphista's adaptation layers, Hydra++'s
prefix layer), once per step over the accepted path's D + 1 slots. Heads are untrained (timing does not
depend on the weights); each function is jitted on its own and timed as the median of `--runs` calls after
a warm-up, with a cache of 256 committed tokens. Writes draft_overhead.json and draft_overhead.md to `--out`.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from amphista_jax.drafters import VARIANTS, Target
from amphista_jax.drafters.base import DraftContext, PrefillContext, Proposal
from amphista_jax.models.llama import Output
from amphista_jax.trees import TreeSpec, batched, get_tree, tree_arrays
from amphista_jax.verify import Verdict
from evals.benchmarks.common import benchmark_parser, load_target, median_seconds, write_report


def cut(spec: TreeSpec, depth: int) -> TreeSpec:
    """The tree's nodes of depth <= `depth`."""
    return TreeSpec(tuple(p for p in spec.choices if len(p) <= depth))


def _context(drafter: Any, params: Any, target: Target, batch: int, committed: int,
             cache_size: int) -> DraftContext:
    """A decoding context after a prefill of `committed` random hidden states."""
    d = target.config.hidden_size
    hidden = jax.random.normal(jax.random.key(1), (batch, committed, d))
    prompt = jax.random.randint(jax.random.key(2), (batch, committed), 0, target.config.vocab_size)
    lengths = jnp.full((batch,), committed, jnp.int32)
    root = prompt[:, -1]
    state = jax.jit(drafter.prefill)(params, target, PrefillContext(Output(hidden, None, None), prompt, lengths, root),
                                     drafter.init_state(target.config, batch, cache_size))
    return DraftContext(hidden[:, -1], root, lengths, state)


def propose_ms(drafter: Any, params: Any, target: Target, ctx: DraftContext, spec: TreeSpec, runs: int) -> float:
    fn = jax.jit(lambda p, t, c: drafter.propose(p, t, c, spec, jax.random.key(0)).tokens)
    return median_seconds(functools.partial(fn, params, target, ctx), runs) * 1e3


def commit_ms(drafter: Any, params: Any, target: Target, ctx: DraftContext, spec: TreeSpec, runs: int) -> float:
    """One commit of a fully accepted first path (D + 1 tokens)."""
    arrays = batched(tree_arrays(spec), ctx.root.shape[0])
    b, n = ctx.root.shape[0], spec.num_nodes
    path = arrays.paths[:, 0]
    verdict = Verdict(path, jnp.full((b,), spec.depth + 1, jnp.int32), ctx.root)
    verify_out = Output(jax.random.normal(jax.random.key(3), (b, n, target.config.hidden_size)), None, None)
    proposal = Proposal(jnp.broadcast_to(ctx.root[:, None], (b, n)), arrays)
    fn = jax.jit(lambda p, t, s: drafter.commit(p, t, proposal, verdict, verify_out, s))
    return median_seconds(functools.partial(fn, params, target, ctx.state), runs) * 1e3


def main() -> None:
    parser = benchmark_parser(__doc__, runs=20)
    parser.add_argument("--methods", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--trees", nargs="+", default=["mc_sim_7b_63", "small-16", "chain-4"])
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    model, target_params, config = load_target(args.model)
    target = Target(config, target_params)
    committed = 256
    rows = []
    for method, tree in tqdm(list(itertools.product(args.methods, args.trees)), desc="draft overhead"):
        drafter, spec = VARIANTS[method], get_tree(tree)
        params = drafter.init(jax.random.key(0), target)
        ctx = _context(drafter, params, target, args.batch, committed, committed + spec.num_nodes + 1)
        by_depth = [propose_ms(drafter, params, target, ctx, cut(spec, d), args.runs) for d in range(1, spec.depth + 1)]
        rows.append({"method": method, "tree": tree, "batch": args.batch, "propose_ms": by_depth[-1],
                     "commit_ms": commit_ms(drafter, params, target, ctx, spec, args.runs),
                     "propose_ms_by_depth": by_depth,
                     "head_increment_ms": [by_depth[0]] + [b - a for a, b in itertools.pairwise(by_depth)]})
    depth = max(len(r["head_increment_ms"]) for r in rows)
    heads = " | ".join(f"head {i + 1}" for i in range(depth))
    lines = [f"model: {model}; batch {args.batch}; {committed} committed tokens; backend: {jax.default_backend()}; "
             "times in ms (median); head i = propose on the tree cut at depth i minus at depth i - 1", "",
             f"| method | tree | propose | commit | {heads} |", "|---|---|---|---|" + "---|" * depth]
    for r in rows:
        inc = [f"{x:.3f}" for x in r["head_increment_ms"]] + ["-"] * (depth - len(r["head_increment_ms"]))
        lines.append(f"| {r['method']} | {r['tree']} | {r['propose_ms']:.3f} | {r['commit_ms']:.3f} | "
                     f"{' | '.join(inc)} |")
    write_report(args.out, "draft_overhead", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
