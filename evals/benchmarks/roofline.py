"""Roofline predictions of the decoding steps on named accelerators, from abstract shapes only (no weights).

    python -m amphista_jax.evals.benchmarks.roofline [--target vicuna-7b] [--model DIR] [--batch 1 4]
        [--context 512 2048] [--dtype bfloat16] [--runs medusa@mc_sim_7b_63 eagle@dynamic ...
        eagle3@dynamic#draft_vocab_size=32000]
        [--accelerators H100-SXM H200 TPU-v5e TPU-v5p] [--tau 2 3 4] [--out runs/benchmarks]

For each (batch, context) the real AR step (`decode.ar_step`, the loop body of `generate`) and the real
speculative step (`decode.spec_step`) of each drafter and tree are lowered and compiled from
`jax.ShapeDtypeStruct`s on this machine's backend, and XLA's cost analysis of the compiled step gives its
floating-point operations and bytes accessed. The target's layers are compiled one module per layer
(`split_layers`): XLA's cost analysis counts a loop's body once, so a scanned stack would be under-counted by
its depth. The drafters' own layers are one-layer stacks and their tree growth is unrolled, so a greedy step
has no other loop (rejection sampling's walk, at temperature > 0, is one). A step's predicted time on an accelerator is
`max(flops / peak bf16 FLOP/s, bytes / HBM bandwidth)` (the roofline: no launch or loop overhead, perfect
overlap), from the vendors' data sheets below. From those: predicted AR tokens/s, the spec-step / AR-step
cost ratio, and the predicted speed-up `tau * AR step / spec step` at the given acceptance lengths `--tau`.
A run is `method@tree`, optionally with the method's settings as in an eval spec (`#key=value,...`);
`draft_vocab_size=N` drafts over N ids (a draft vocabulary of that size: its shapes are what a cost needs).

Every figure is a model prediction, not a measurement. Compiled on CPU, the cost analysis reflects XLA:CPU's
fusion decisions: its byte count includes intermediates and layout copies a GPU kernel may avoid, so
memory-bound predictions err on the slow side. XLA:CPU computes bf16 matrix products through fp32 converts,
which its cost analysis counts, so the steps are compiled in fp32 and their bytes scaled to `--dtype`'s size.
Writes roofline.json and roofline.md to `--out`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from amphista_jax.drafters import VARIANTS, Drafter
from amphista_jax.engine import memory_plan as plan
from amphista_jax.engine.decode import ar_init, ar_step, spec_init, spec_step
from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.evals.benchmarks.common import benchmark_parser, write_report
from amphista_jax.evals.methods import parse_settings
from amphista_jax.facade.drafter_source import with_settings
from amphista_jax.infra.accelerators import ACCELERATORS, Accelerator
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.fetch import resolve_model
from amphista_jax.models.llama import param_shapes, target_model
from amphista_jax.models.shapes import KNOWN_TARGETS
from amphista_jax.models.target import Target
from amphista_jax.train.config import DRAFT_VOCAB_SIZE
from amphista_jax.trees.names import get_tree

MAX_NEW_TOKENS = 128

DEFAULT_RUNS = ("medusa@mc_sim_7b_63", "medusa@chain-4", "amphista@mc_sim_7b_63", "hydra@mc_sim_7b_63",
                "hydra++@mc_sim_7b_63", "eagle@mc_sim_7b_63", "eagle@dynamic", "gumiho@dynamic-63x7x35",
                "sar@mc_sim_7b_63", "sar-lstm@mc_sim_7b_63")


def compiled_cost(fn: Callable[..., Any], *args: Any) -> dict[str, float]:
    """{"flops", "bytes"} of `fn` compiled for `args` (arrays or `jax.ShapeDtypeStruct`s)."""
    cost = plan.compiled_cost(jax.jit(fn).lower(*args).compile())
    if len(cost) < 2:
        raise SystemExit(f"XLA on {jax.default_backend()} gives no cost analysis of the compiled step: run the "
                         "roofline on CPU (JAX_PLATFORMS=cpu)")
    return cost


def ar_cost(config: ModelConfig, params: Any, batch: int, context: int) -> dict[str, float]:
    """Cost of one `ar_step` with `context` committed tokens per row; `params` in the `split_layers` layout."""
    model = target_model(config, params)
    prompt = jax.ShapeDtypeStruct((batch, context), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    state = jax.eval_shape(lambda p, t, n: ar_init(model, p, t, n, jax.random.key(0), context + MAX_NEW_TOKENS,
                                                   MAX_NEW_TOKENS), params, prompt, lengths)
    return compiled_cost(functools.partial(ar_step, model), params, state)


def run_drafter(run: str) -> tuple[str, str, str, Drafter]:
    """(method, tree, settings, drafter) of a run `method@tree[#key=value,...]`."""
    head, _, overrides = run.partition("#")
    method, _, tree = head.partition("@")
    if method not in VARIANTS or not tree:
        raise ValueError(f"run {run!r} must be method@tree[#key=value,...] with a method of {', '.join(VARIANTS)}")
    settings = parse_settings(run, overrides)
    if size := settings.pop(DRAFT_VOCAB_SIZE, 0):
        settings["draft_vocab"] = tuple(range(size))
    return method, tree, overrides, with_settings(VARIANTS[method], settings)


def spec_cost(config: ModelConfig, params: Any, drafter: Drafter, tree_name: str, batch: int,
              context: int) -> tuple[dict[str, float], int]:
    """(cost of one `spec_step` with `context` committed tokens per row, the tree's node budget); `params` in the
    `split_layers` layout."""
    tree = get_tree(tree_name)
    draft = jax.eval_shape(lambda p: drafter.decode_params(drafter.init(jax.random.key(0), Target(config, p)),
                                                           Target(config, p)),
                           params)
    settings = DecodeSpec(config, drafter, tree, MAX_NEW_TOKENS)
    cache_size = settings.cache_size(context)
    prompt = jax.ShapeDtypeStruct((batch, context), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    state = jax.eval_shape(lambda p, d, t, n: spec_init(p, d, t, n, jax.random.key(0), cache_size, settings),
                           params, draft, prompt, lengths)
    return compiled_cost(functools.partial(spec_step, spec=settings), params, draft, state), tree.num_nodes


def run_label(row: dict[str, Any]) -> str:
    """A row's run as it was asked for: `method@tree` and its settings, if any
    (`eagle3@dynamic#draft_vocab_size=32000`); `ar` for the AR step."""
    if row["method"] == "ar":
        return "ar"
    return f"{row['method']}@{row['tree']}" + (f"#{row['settings']}" if row.get("settings") else "")


def predict(cost: dict[str, float], accelerators: list[Accelerator]) -> dict[str, dict[str, Any]]:
    return {a.name: {"ms": a.seconds(cost["flops"], cost["bytes"]) * 1e3, "bound": a.bound(cost["flops"],
                                                                                             cost["bytes"])}
            for a in accelerators}


def main() -> None:
    parser = benchmark_parser(__doc__)  # --model: a Hugging Face model directory (its config.json only)
    parser.add_argument("--target", default="vicuna-7b", choices=list(KNOWN_TARGETS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, nargs="+", default=[512])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), help="method@tree")
    parser.add_argument("--accelerators", nargs="+", default=["H100-SXM", "H200", "TPU-v5e", "TPU-v5p"],
                        choices=list(ACCELERATORS))
    parser.add_argument("--tau", type=float, nargs="+", default=[2.0, 3.0, 4.0])
    args = parser.parse_args()
    config = (ModelConfig.from_json(f"{resolve_model(args.model)}/config.json") if args.model
              else KNOWN_TARGETS[args.target]())
    # XLA:CPU runs bf16 matrix products through fp32 converts, and its cost analysis counts them (a bf16 AR step
    # of Vicuna-7B "accesses" 83 GB for 13.5 GB of weights). So the steps are compiled in fp32, whose op structure
    # is the accelerators', and the bytes scaled to --dtype's size (weights, caches and activations alike).
    params = param_shapes(config, jnp.float32, split=True)[0]
    scale = jnp.dtype(args.dtype).itemsize / 4
    accelerators = [ACCELERATORS[a] for a in args.accelerators]
    try:
        runs = [run_drafter(r) for r in args.runs]
        for _, tree, _, drafter in runs:
            drafter.check_tree(get_tree(tree))
    except ValueError as e:
        parser.error(str(e))
    rows = []
    for batch, context in tqdm(list(itertools.product(args.batch, args.context)), desc="roofline"):
        ar = ar_cost(config, params, batch, context)
        ar["bytes"] *= scale
        ar_pred = predict(ar, accelerators)
        rows.append({"batch": batch, "context": context, "method": "ar", "tree": "-", "nodes": 1, **ar,
                     "predicted": ar_pred})
        for method, tree, settings, drafter in tqdm(runs, desc=f"batch {batch}, context {context}", leave=False):
            cost, nodes = spec_cost(config, params, drafter, tree, batch, context)
            cost["bytes"] *= scale
            pred = predict(cost, accelerators)
            rows.append({"batch": batch, "context": context, "method": method, "tree": tree, "settings": settings,
                         "nodes": nodes, **cost,
                         "predicted": pred,
                         "step_ratio": {a: pred[a]["ms"] / ar_pred[a]["ms"] for a in pred},
                         "speedup": {a: {str(t): t * ar_pred[a]["ms"] / pred[a]["ms"] for t in args.tau}
                                     for a in pred}})
    name = args.model or args.target
    head = "".join(f" {a.name} ms (bound) | {a.name} ratio |" for a in accelerators)
    taus = "/".join(f"{t:g}" for t in args.tau)
    lines = [f"Roofline **predictions** (not measurements) for {name} ({config.num_params / 1e9:.2f}B parameters, "
             f"{args.dtype}), from XLA's cost analysis of the compiled steps ({jax.default_backend()} backend); "
             f"time = max(flops / peak, bytes / bandwidth); ratio = step / AR step on that accelerator; "
             f"speed-up at tau {taus} on {accelerators[0].name}.", "",
             f"| batch | context | run | nodes | GFLOP | GB accessed |{head} speed-up @ tau {taus} |",
             "|---|---|---|---|---|---|" + "---|---|" * len(accelerators) + "---|"]
    for r in rows:
        cells = "".join(f" {r['predicted'][a.name]['ms']:.3f} ({r['predicted'][a.name]['bound']}) | "
                        f"{r.get('step_ratio', {}).get(a.name, 1.0):.2f} |" for a in accelerators)
        speed = " / ".join(f"{x:.2f}x" for x in r["speedup"][accelerators[0].name].values()) if "speedup" in r else "-"
        lines.append(f"| {r['batch']} | {r['context']} | {run_label(r)} | {r['nodes']} | "
                     f"{r['flops'] / 1e9:.2f} | {r['bytes'] / 1e9:.3f} |{cells} {speed} |")
    ar_rows = [r for r in rows if r["method"] == "ar"]
    lines += ["", "Predicted AR tokens/s: " + "; ".join(
        f"batch {r['batch']}, context {r['context']}: " + ", ".join(
            f"{a.name} {r['batch'] * 1e3 / r['predicted'][a.name]['ms']:.0f}" for a in accelerators) for r in ar_rows)]
    write_report(args.out, "roofline", {"model": name, "dtype": args.dtype, "params": config.num_params,
                                        "backend": jax.default_backend(), "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
