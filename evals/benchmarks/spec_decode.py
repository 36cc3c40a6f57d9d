"""AR vs speculative decoding on one target, and the cost of one verify step vs tree size.

    python -m amphista_jax.evals.benchmarks.spec_decode [--model DIR] [--heads DIR [DIR ...]]
        [--trees auto mc_sim_7b_63 chain-4] [--new-tokens 128] [--runs 3] [--out runs/benchmarks]

Part 1 runs the AR baseline and each set of heads (any method: Medusa, Amphista, ...) with each tree
(`auto`: the tree `--tree auto` chooses for each set of heads on this machine, calibrated on first use) on the
same prompts and settings (greedy,
batch 1), checks the outputs are identical, and prints tokens/s, tau (tokens per decoding forward; the
prefill's token is not counted) and speed-up over AR, medians of `--runs` timed runs after a warm-up. Without
`--heads` the heads are untrained (tau near 1): the numbers then show the engine's overhead, not a method.
Part 2 times one target forward over T tree tokens (T = 1, 8, 16, 32, 64) on a cache of committed tokens:
on a compute-bound CPU the verify cost grows with T, which is where speculative decoding's crossover lies.
Writes spec_decode.json and spec_decode.md to `--out`.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.drafters import Medusa
from amphista_jax.drafters.io import load_draft
from amphista_jax.engine.decode import generate, pad_prompts, speculative_generate
from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.evals.benchmarks.common import benchmark_parser, load_target, median_seconds, write_report
from amphista_jax.facade.generator import Generator
from amphista_jax.facade.target import LoadedTarget
from amphista_jax.models.llama import new_cache, target_model
from amphista_jax.models.target import Target
from amphista_jax.models.tokenizer import encode_prompt, load_tokenizer
from amphista_jax.trees.names import AUTO, resolve_tree
from amphista_jax.trees.tree import TreeSpec, tree_arrays

PROMPTS = (
    "def binary_search(items, target):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "import json\n\n\ndef load_config(path):\n",
)



def end_to_end(base: Generator, drafters: list[tuple[str, object, object, str | None]], trees, new_tokens: int,
               runs: int) -> list[dict]:
    """`drafters`: (label, drafter, draft params, heads directory) tuples, all timed against one AR run per
    prompt on `base`'s target."""
    params, config, tok = base.params, base.config, base.tokenizer
    rows = []
    specs = {}
    for (label, drafter, draft_params, heads), name in itertools.product(drafters, trees):
        if name == AUTO and heads is not None:  # chosen on this machine, as `Generator` does
            gen = base.with_drafter(heads, name, draft_params=draft_params).for_batch(1)
            tree = gen.tree if gen.drafter is not None else None
        else:
            tree, note = resolve_tree(name, heads, drafter.paper_tree)
            if note:
                print(f"note: {note}", file=sys.stderr)
        if tree is not None:  # None: `auto` chose no speculation here (that row is the AR row)
            specs[label, name] = tree
    drafter_of = {label: drafter for label, drafter, _, _ in drafters}
    decodes = [DecodeSpec(config, drafter_of[label], tree, new_tokens) for (label, _), tree in specs.items()]
    for prompt in PROMPTS:
        tokens, lengths = pad_prompts([encode_prompt(tok, prompt)], pad_id=config.pad_token_id or 0)
        cache = max(d.cache_size(tokens.shape[1]) for d in decodes)  # one cache for every method: only steps differ
        ar = functools.partial(generate, params, tokens, lengths, jax.random.key(0), config=config,
                               max_new_tokens=new_tokens, cache_size=cache)
        ar_out = ar()
        ar_s = median_seconds(ar, runs)
        rows.append({"prompt": prompt, "method": "ar", "tree": "-", "tokens_per_s": new_tokens / ar_s, "tau": 1.0,
                     "speedup": 1.0, "same_as_ar": True})
        for (label, drafter, draft_params, _), name in itertools.product(drafters, trees):
            if (label, name) not in specs:
                continue
            spec = functools.partial(speculative_generate, params, draft_params, tokens, lengths, jax.random.key(0),
                                     config=config, drafter=drafter, tree=specs[label, name],
                                     max_new_tokens=new_tokens, cache_size=cache)
            out = spec()
            seconds = median_seconds(spec, runs)
            tree = f"{name} ({specs[label, name].num_nodes - 1} nodes)" if name == "auto" else name
            rows.append({"prompt": prompt, "method": label, "tree": tree, "tokens_per_s": new_tokens / seconds,
                         "tau": float(out.tau[0]), "speedup": ar_s / seconds,
                         "same_as_ar": bool((np.asarray(out.tokens) == np.asarray(ar_out.tokens)).all())})
    return rows


def verify_cost(params, config, sizes: tuple[int, ...], committed: int, runs: int) -> list[dict]:
    model = target_model(config, params)
    step = jax.jit(lambda p, c, tk, pos, m: model.apply({"params": p}, tk, pos, c, m).logits)
    rows = []
    for t in sizes:
        spec = TreeSpec(tuple((i,) for i in range(t - 1)))  # root + (t - 1) children: t query tokens
        arrays = tree_arrays(spec)
        cache = new_cache(config, 1, committed + t).advance(committed)
        tokens = jnp.zeros((1, t), jnp.int32)
        positions = committed + jnp.asarray(arrays.depth)[None]
        mask = jnp.asarray(arrays.mask)[None]
        seconds = median_seconds(functools.partial(step, params, cache, tokens, positions, mask), max(runs, 10))
        rows.append({"tree_nodes": t, "verify_ms": seconds * 1e3})
    base = rows[0]["verify_ms"]
    for r in rows:
        r["cost_vs_1"] = r["verify_ms"] / base
    return rows


def main() -> None:
    parser = benchmark_parser(__doc__, runs=3)
    parser.add_argument("--heads", nargs="+", default=[], help="draft-head checkpoints (default: untrained Medusa)")
    parser.add_argument("--trees", nargs="+", default=["mc_sim_7b_63", "small-16", "small-8", "chain-4"],
                        help="presets, JSON files, or `auto` (the tree chosen for each set of heads on this machine)")
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    model, params, config = load_target(args.model)
    tok = load_tokenizer(model)
    drafters = []
    for path in args.heads:
        method, drafter, draft_params = load_draft(path, config, params)
        drafters.append((method if len(args.heads) == 1 else f"{method} ({path})", drafter, draft_params, path))
    if not drafters:
        drafters = [("untrained medusa", Medusa(), Medusa().init(jax.random.key(0), Target(config, params)), None)]
    base = Generator.load(LoadedTarget.from_params(config, params, tok, model_dir=model))
    e2e = end_to_end(base, drafters, args.trees, args.new_tokens, args.runs)
    cost = verify_cost(params, config, (1, 8, 16, 32, 64), committed=256, runs=args.runs)

    lines = [f"model: {model}; heads: {', '.join(args.heads) or 'untrained medusa'}; backend: {jax.default_backend()}",
             "",
             "| method | tree | tokens/s | tau | speed-up | same as AR |", "|---|---|---|---|---|---|"]
    for method, tree in dict.fromkeys((r["method"], r["tree"]) for r in e2e):
        sel = [r for r in e2e if r["method"] == method and r["tree"] == tree]
        mean = lambda k, sel=sel: statistics.mean(r[k] for r in sel)  # noqa: E731
        lines.append(f"| {method} | {tree} | {mean('tokens_per_s'):.1f} | {mean('tau'):.2f} | "
                     f"{mean('speedup'):.2f}x | {all(r['same_as_ar'] for r in sel)} |")
    lines += ["", "| tree nodes | verify ms | cost vs 1 node |", "|---|---|---|"]
    lines += [f"| {r['tree_nodes']} | {r['verify_ms']:.2f} | {r['cost_vs_1']:.2f}x |" for r in cost]
    write_report(args.out, "spec_decode", {"end_to_end": e2e, "verify_cost": cost}, "\n".join(lines))


if __name__ == "__main__":
    main()
