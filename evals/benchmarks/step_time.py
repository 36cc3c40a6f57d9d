"""Time of one speculative decoding step per method and tree, next to one AR step, on the same target.

    python -m amphista_jax.evals.benchmarks.step_time [--model DIR | --target llama-3-8b]
        [--methods medusa amphista hydra hydra++] [--trees mc_sim_7b_63 chain-4] [--pairs eagle3@dynamic ...]
        [--batch 1 16 64]
        [--context 512] [--dtype bfloat16] [--attention xla pallas] [--new-tokens 64] [--runs 5]
        [--out runs/benchmarks]

A step is the whole loop body (`spec_step`: propose, verify forward, accept, compact, commit, emit), timed as
tree search prices trees (`step_clock.StepClock`): (decode time - prefill time) / steps, `--batch` copies of
one prompt, no EOS stop, the fastest of `--runs` runs after a warm-up, every program of a batch size in one cache
size. The AR step is timed once per batch size and attention path. `--target` times a known shape (Vicuna,
LLaMA-3, `models.shapes`) with random weights, so a GPU or TPU can time a real model's steps with nothing to
load: a step's time depends on the shapes, not on the weights (an untrained drafter's acceptance changes the
number of steps, which the time is divided by). `--context` sets the prompt to that many random token ids (0:
a short code prompt through the model's tokenizer; a `--target` has none and needs `--context`). With
`--model` or the embedded model each method uses the heads shipped for it when there are some, else untrained
heads. `--pairs` times only the named `method@tree` pairs (in place of every method on every tree). A
(method, tree) pair the method cannot draft is listed as skipped. Comparing two versions of the engine
means running this script under each (e.g. `PYTHONPATH=<checkout>`) on an otherwise idle machine,
alternately. Writes step_time.json and step_time.md to `--out` after every batch size, so a run cut short keeps
what it measured.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from amphista_jax.assets import shipped_heads, shipped_heads_dir
from amphista_jax.choice.step_clock import StepClock
from amphista_jax.drafters import VARIANTS, Drafter
from amphista_jax.drafters.io import cast_floating, load_draft
from amphista_jax.evals.benchmarks.common import benchmark_parser, write_report
from amphista_jax.facade.generator import Generator
from amphista_jax.facade.target import LoadedTarget
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.fetch import resolve_model
from amphista_jax.models.hf import load_params
from amphista_jax.models.llama import init_params
from amphista_jax.models.param_layout import split_layers
from amphista_jax.models.shapes import KNOWN_TARGETS
from amphista_jax.models.target import Target
from amphista_jax.models.tokenizer import encode_prompt, load_tokenizer
from amphista_jax.trees.names import get_tree
from amphista_jax.trees.tree import TreeError

SHIPPED_NAME = {"hydra++": "hydra-plus"}
PROMPT = "def binary_search(items, target):\n"


def random_target(name: str, dtype: str, layout: str) -> tuple[dict, ModelConfig]:
    """Random weights of the known shape `name` in `dtype` and `layout`, made on the device."""
    config = KNOWN_TARGETS[name]()
    params = jax.jit(functools.partial(init_params, config, param_dtype=jnp.dtype(dtype)))(jax.random.key(0))
    return (split_layers(params) if layout == "split" else params), config


def method_drafter(method: str, config: ModelConfig, params: dict, dtype: str, shipped: list[str]
                   ) -> tuple[Drafter, Any, str]:
    """(`method`'s drafter, its draft params in `dtype`, which heads they are)."""
    name = SHIPPED_NAME.get(method, method)
    if name in shipped:
        _, drafter, draft_params = load_draft(shipped_heads_dir(name), config, params)
        heads = f"shipped {name}"
    else:
        drafter, heads = VARIANTS[method], "untrained"
        draft_params = drafter.init(jax.random.key(0), Target(config, params))
    return drafter, cast_floating(draft_params, dtype), heads


def table(rows: list[dict], header: str) -> str:
    lines = [header, "", "| batch | attention | method | heads | tree | nodes | step ms | AR step ms | step / AR |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        timed = (f"{r['step_ms']:.3f} | {r['ar_step_ms']:.3f} | {r['step_vs_ar']:.2f}" if "step_ms" in r
                 else "skipped (it cannot draft this tree) | | ")
        lines.append(f"| {r['batch']} | {r['attention']} | {r['method']} | {r['heads']} | {r['tree']} | "
                     f"{r['nodes']} | {timed} |")
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__doc__, runs=5)
    parser.add_argument("--target", choices=list(KNOWN_TARGETS), help="random weights of this shape, not --model")
    parser.add_argument("--methods", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--trees", nargs="+", default=["mc_sim_7b_63", "chain-4"])
    parser.add_argument("--pairs", nargs="+", metavar="METHOD@TREE",
                        help="only these (method, tree) pairs, in place of --methods x --trees")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--attention", nargs="+", default=["xla"], choices=["xla", "pallas"])
    parser.add_argument("--layout", default="split", choices=["split", "stacked"],
                        help="the target's layers one module each (decoding's default) or one scanned stack")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.target and args.model:
        parser.error("--target (random weights of a known shape) and --model (a checkpoint) exclude each other")
    if args.target and args.context < 1:
        parser.error(f"--target {args.target} has no tokenizer: give the prompt's length with --context N")
    if min(args.batch) < 1 or args.context < 0:
        parser.error("--batch sizes must be >= 1 and --context >= 0")
    if args.pairs:
        wanted = [tuple(p.split("@", 1)) for p in args.pairs]
        if bad := [p for p, w in zip(args.pairs, wanted, strict=True) if len(w) != 2 or w[0] not in VARIANTS]:
            parser.error(f"--pairs {' '.join(bad)}: each is METHOD@TREE, METHOD one of {', '.join(VARIANTS)}")
        args.methods, args.trees = list(dict.fromkeys(m for m, _ in wanted)), list(dict.fromkeys(t for _, t in wanted))
    try:
        trees = {name: get_tree(name) for name in args.trees}
    except TreeError as e:
        parser.error(str(e))
    if args.target:
        params, config = random_target(args.target, args.dtype, args.layout)
        tokenizer, label, shipped = None, args.target, []
    else:
        label = str(resolve_model(args.model))
        params, config = load_params(label, dtype=args.dtype, layout=args.layout)
        tokenizer = load_tokenizer(label)
        shipped = shipped_heads() if args.model is None else []
    prompt = (np.random.default_rng(0).integers(0, config.vocab_size, args.context).tolist() if args.context
              else encode_prompt(tokenizer, PROMPT, chat=False))
    drafters = {m: method_drafter(m, config, params, args.dtype, shipped) for m in args.methods}
    pairs = []  # (method, tree name, why it is skipped or None)
    for method, (drafter, _, _) in drafters.items():
        for name, tree in trees.items():
            if args.pairs and f"{method}@{name}" not in args.pairs:
                continue
            try:
                drafter.check_tree(tree, config.vocab_size)
                pairs.append((method, name, None))
            except TreeError as e:
                pairs.append((method, name, str(e)))
    header = (f"model: {label} ({config.num_params / 1e9:.3g}B parameters, {args.dtype}, {args.layout} layers); "
              f"prompt {len(prompt)} tokens; {args.new_tokens} new tokens; fastest of {args.runs} runs; "
              f"device: {jax.default_backend()} ({jax.devices()[0].device_kind})")
    rows: list[dict] = []
    runs = [(b, a) for b in args.batch for a in args.attention]
    with tqdm(total=len(runs) * (1 + sum(why is None for *_, why in pairs)), desc="step time", unit="step") as bar:
        for batch, attention in runs:
            base = Generator.load(LoadedTarget.from_params(config, params, tokenizer, attention=attention))
            drawable = {m: [n for m2, n, why in pairs if m2 == m and why is None] for m in drafters}
            on = {m: base.with_drafter(d, trees[drawable[m][0]], draft_params=dp)
                  for m, (d, dp, _) in drafters.items() if drawable[m]}
            clock = StepClock.for_trees([base, *on.values()], prompt, list(trees.values()), args.new_tokens,
                                        args.runs, batch)
            ar_s = clock.ar_step_seconds(base)
            bar.update(1)
            for method in drafters:
                names = drawable[method]
                seconds = clock.spec_step_seconds(on[method], [trees[n] for n in names], bar.update) if names else []
                timed = dict(zip(names, seconds, strict=True))
                for m, name, why in pairs:
                    if m != method:
                        continue
                    row = {"batch": batch, "attention": attention, "method": method, "heads": drafters[method][2],
                           "tree": name, "nodes": trees[name].num_nodes}
                    if why is None:
                        s = timed[name]
                        row |= {"step_ms": s * 1e3, "ar_step_ms": ar_s * 1e3, "step_vs_ar": s / ar_s}
                    else:
                        row["skipped"] = why
                    rows.append(row)
            write_report(args.out, "step_time", {"model": label, "dtype": args.dtype, "layout": args.layout,
                                                 "context": len(prompt),
                                                 "device": jax.devices()[0].device_kind, "rows": rows},
                         table(rows, header))


if __name__ == "__main__":
    main()
