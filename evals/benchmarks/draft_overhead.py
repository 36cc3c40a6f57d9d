"""Where a speculative step's time goes: the parts of the real `spec_step`, per method and tree.

    python -m amphista_jax.evals.benchmarks.draft_overhead [--model DIR | --size 150m]
        [--methods medusa amphista hydra hydra++] [--trees mc_sim_7b_63 small-16 chain-4] [--batch 1]
        [--committed 256] [--runs 20] [--out runs/benchmarks]

The target is `--model` (default: the embedded one) or, with `--size`, a random-init fp32 Llama of one of
`common.SIZES`, in decoding's `split_layers` layout either way.

The state is the engine's own: `spec_init` on random prompts of `--committed` tokens (the target's prefill,
then the drafter's), then one `spec_step`. On that state each part of the step is jitted on its own and timed
(median of `--runs` calls after a warm-up):
- propose: `spec_propose`, the drafter's tree and tokens;
- verify: `spec_verify`, one target forward over the tree and the acceptance rule; its query rows are the tree's
  nodes plus the drafter's verify-time extras (`queries`: BiTA's mask groups, N x M of them), so the extras'
  cost is the verify time of such a method minus that of one without extras (Medusa) on the same tree;
- commit: the drafter's `commit` alone (its own causal layers: Amphista's adaptation layers, Hydra++'s prefix
  layer), on that step's real proposal and verdict;
- engine commit: `spec_commit`, i.e. KV compaction + the drafter's commit + emit;
- step: the whole `spec_step`. The parts are jitted apart, so they need not add up to it exactly;
- draft share: (propose + commit) / step, the drafter's part of a step;
- AR step: the target's one-token step (`ar_step`, the loop body of `generate`) at the same committed length;
  draft / AR = (propose + commit) / AR step;
- draft / target bytes: the drafter's parameter bytes over the target's. Memory-bound, a step that reads every
  drafter weight (a Medusa-style head has its own `[D, V]` projection) costs at least this share of an AR step.
Hydra's appendix D (Table 1) splits the draft overhead into each head; here that split comes from timing
`spec_propose` with the tree cut at depth 1, 2, ..., D: the increments are what each deeper head adds (for
Medusa and Amphista, whose heads all run in one pass, they are ~0 apart from the top-k gather). A method name
takes the heads shipped for `--model`, else untrained ones; a heads directory its trained heads and their settings
(a step's time depends on the settings and the tree's shape, not on the weights). Writes draft_overhead.json and
draft_overhead.md to `--out`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from amphista_jax.drafters import VARIANTS
from amphista_jax.engine.decode import (
    SpecState,
    ar_init,
    ar_step,
    spec_commit,
    spec_init,
    spec_propose,
    spec_step,
    spec_verify,
)
from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.evals.benchmarks.common import (
    SIZES,
    benchmark_parser,
    load_target,
    median_seconds,
    model_config,
    nbytes,
    random_target,
    write_report,
)
from amphista_jax.facade.drafter_source import load_draft_params, read_source
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import target_model
from amphista_jax.models.target import Target
from amphista_jax.trees.names import get_tree
from amphista_jax.trees.tree import TreeSpec

MAX_NEW_TOKENS = 64


def cut(spec: TreeSpec, depth: int) -> TreeSpec:
    """The tree's nodes of depth <= `depth`."""
    return TreeSpec(tuple(p for p in spec.choices if len(p) <= depth))


def steady_state(params: dict, draft_params: Any, settings: DecodeSpec, batch: int, committed: int) -> SpecState:
    """The engine's state after a prefill of `batch` random prompts of `committed` tokens and one step."""
    prompt = jax.random.randint(jax.random.key(2), (batch, committed), 0, settings.config.vocab_size)
    lengths = jnp.full((batch,), committed, jnp.int32)
    init = jax.jit(spec_init, static_argnames=("cache_size", "spec"))
    state = init(params, draft_params, prompt, lengths, jax.random.key(0),
                 cache_size=settings.cache_size(committed),
                 spec=settings)
    return jax.jit(functools.partial(spec_step, spec=settings))(params, draft_params, state)


def ar_step_ms(params: dict, config: ModelConfig, batch: int, committed: int, runs: int) -> float:
    """Milliseconds of one AR step (`ar_step`) after a prefill of `batch` random prompts of `committed` tokens."""
    model = target_model(config, params)
    prompt = jax.random.randint(jax.random.key(2), (batch, committed), 0, config.vocab_size)
    lengths = jnp.full((batch,), committed, jnp.int32)
    init = jax.jit(functools.partial(ar_init, model, cache_size=committed + MAX_NEW_TOKENS,
                                     max_new_tokens=MAX_NEW_TOKENS))
    state = init(params, prompt, lengths, jax.random.key(0))
    return part_ms(functools.partial(ar_step, model), params, state, runs=runs)


def part_ms(fn: Callable[..., Any], *args: Any, runs: int) -> float:
    return median_seconds(functools.partial(jax.jit(fn), *args), runs) * 1e3


def step_parts_ms(params: dict, draft_params: Any, settings: DecodeSpec, s: SpecState, runs: int) -> dict:
    """Milliseconds of each part of one step from state `s`."""
    st = settings
    proposal = jax.jit(functools.partial(spec_propose, spec=st))(params, draft_params, s)
    verified, verdict = jax.jit(functools.partial(spec_verify, spec=st))(params, s, proposal)
    times = {
        "propose_ms": part_ms(functools.partial(spec_propose, spec=st), params, draft_params, s, runs=runs),
        "verify_ms": part_ms(functools.partial(spec_verify, spec=st), params, s, proposal, runs=runs),
        "commit_ms": part_ms(lambda p, d, pr, o, v, ds: st.drafter.commit(d, Target(st.config, p), pr, v, o, ds),
                             params, draft_params, proposal, verified, verdict, s.draft_state, runs=runs),
        "engine_commit_ms": part_ms(functools.partial(spec_commit, spec=st), params, draft_params, s, proposal,
                                    verified, verdict, runs=runs),
        "step_ms": part_ms(functools.partial(spec_step, spec=st), params, draft_params, s, runs=runs),
    }
    return times | {"draft_share": (times["propose_ms"] + times["commit_ms"]) / times["step_ms"]}


def main() -> None:
    parser = benchmark_parser(__doc__, runs=20)
    parser.add_argument("--methods", nargs="+", default=list(VARIANTS),
                        help="method names (the heads shipped for --model, else untrained ones) or trained heads "
                             "directories (their settings: block size, layers, draft vocabulary)")
    parser.add_argument("--trees", nargs="+", default=["mc_sim_7b_63", "small-16", "chain-4"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--committed", type=int, default=256)
    parser.add_argument("--size", choices=list(SIZES), help="a random-init target of this size instead of --model")
    args = parser.parse_args()
    if args.size and args.model:
        parser.error("--size and --model name two targets: give one")
    if args.size:
        model, config = f"random-init llama-{args.size}", model_config(args.size)
        params = random_target(config)
    else:
        model, params, config = load_target(args.model)
    target = Target(config, params)
    ar_ms = ar_step_ms(params, config, args.batch, args.committed, args.runs)
    rows = []
    for method, tree in tqdm(list(itertools.product(args.methods, args.trees)), desc="draft overhead"):
        model_dir = None if args.size else model
        drafter, draft_params = load_draft_params(read_source(method, model_dir, config), target, model_dir,
                                                  "float32")
        draft_params, spec = drafter.decode_params(draft_params, target), get_tree(tree)
        settings = DecodeSpec(config, drafter, spec, MAX_NEW_TOKENS)
        s = steady_state(params, draft_params, settings, args.batch, args.committed)
        cuts = range(1, spec.depth + 1) if isinstance(spec, TreeSpec) else ()  # a dynamic budget has no cuts
        by_depth = [part_ms(functools.partial(spec_propose, spec=dataclasses.replace(settings, tree=cut(spec, d))),
                            params, draft_params, s, runs=args.runs) for d in cuts]
        parts = step_parts_ms(params, draft_params, settings, s, args.runs)
        rows.append({"method": method, "tree": tree, "nodes": spec.num_nodes,
                     "queries": settings.scratch, "batch": args.batch, **parts,
                     "ar_step_ms": ar_ms, "draft_over_ar": (parts["propose_ms"] + parts["commit_ms"]) / ar_ms,
                     "draft_over_target_bytes": nbytes(draft_params) / nbytes(params),
                     "propose_ms_by_depth": by_depth,
                     "head_increment_ms": by_depth[:1] + [b - a for a, b in itertools.pairwise(by_depth)]})
    depth = max(len(r["head_increment_ms"]) for r in rows)
    heads = "".join(f" head {i + 1} |" for i in range(depth))
    lines = [f"model: {model}; batch {args.batch}; {args.committed} committed tokens; backend: "
             f"{jax.default_backend()}; times in ms (median of {args.runs}); each part of `spec_step` jitted on its "
             f"own; AR step {ar_ms:.3f} ms; queries = verify query rows (tree nodes + the drafter's extras); draft "
             "share = (propose + commit) / step; draft / AR = (propose + commit) / AR step; bytes = drafter / target "
             "parameter bytes; head i = propose on the tree cut at depth i minus at depth i - 1", "",
             f"| method | tree | nodes | queries | propose | verify | commit | engine commit | step | draft share | "
             f"draft / AR | bytes |{heads}",
             "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * depth]
    for r in rows:
        inc = [f"{x:.3f}" for x in r["head_increment_ms"]] + ["-"] * (depth - len(r["head_increment_ms"]))
        lines.append(f"| {r['method']} | {r['tree']} | {r['nodes']} | {r['queries']} | {r['propose_ms']:.3f} | "
                     f"{r['verify_ms']:.3f} | {r['commit_ms']:.3f} | {r['engine_commit_ms']:.3f} | "
                     f"{r['step_ms']:.3f} | "
                     f"{r['draft_share']:.0%} | {r['draft_over_ar']:.0%} | {r['draft_over_target_bytes']:.0%} |"
                     + "".join(f" {x} |" for x in inc))
    write_report(args.out, "draft_overhead", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
