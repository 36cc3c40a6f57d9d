"""Time of one speculative decoding step per method and tree, next to one AR step, on the same target.

    python -m amphista_jax.evals.benchmarks.step_time [--model DIR] [--methods medusa amphista hydra hydra++]
                                         [--trees mc_sim_7b_63 chain-4] [--new-tokens 64] [--runs 5]
                                         [--out runs/benchmarks]

A step is the whole loop body (`spec_step`: propose, verify forward, accept, compact, commit, emit), timed as
`tree_search.measure_step_seconds` does: (decode time - prefill time) / steps, batch 1, no EOS stop, the
median of `--runs` runs after a warm-up. Each method uses the heads shipped for the default model when
there are some (else untrained heads): a step's time depends on the tree's shape, not on what the heads
draft. Comparing two versions of the engine means running this script under each (e.g.
`PYTHONPATH=<checkout>`) on an otherwise idle machine, alternately. Writes step_time.json and step_time.md
to `--out`.
"""

from __future__ import annotations

import jax
from tqdm import tqdm

from amphista_jax.assets import shipped_heads, shipped_heads_dir
from amphista_jax.drafters import VARIANTS
from amphista_jax.drafters.io import load_draft
from amphista_jax.evals.benchmarks.common import benchmark_parser, load_target, write_report
from amphista_jax.generator import Generator
from amphista_jax.target import Target
from amphista_jax.tokenizer import encode_prompt, load_tokenizer
from amphista_jax.tree_names import get_tree
from amphista_jax.tree_search import measure_step_seconds

SHIPPED_NAME = {"hydra++": "hydra-plus"}
PROMPT = "def binary_search(items, target):\n"


def main() -> None:
    parser = benchmark_parser(__doc__, runs=5)
    parser.add_argument("--methods", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--trees", nargs="+", default=["mc_sim_7b_63", "chain-4"])
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model, params, config = load_target(args.model)
    target = Target(config, params)
    tok = load_tokenizer(model)
    prompt = encode_prompt(tok, PROMPT, chat=False)
    shipped = shipped_heads() if args.model is None else []
    rows = []
    for method in tqdm(args.methods, desc="step time"):
        drafter, heads = VARIANTS[method], "untrained"
        draft_params = drafter.init(jax.random.key(0), target)
        name = SHIPPED_NAME.get(method, method)
        if name in shipped:
            _, drafter, draft_params = load_draft(shipped_heads_dir(name), config, params)
            heads = f"shipped {name}"
        trees = [get_tree(t) for t in args.trees]
        gen = Generator(config, params, tok, (), drafter, draft_params, trees[0])
        ar_s, step_s = measure_step_seconds(gen, prompt, trees, args.new_tokens, args.runs)
        for name, tree, s in zip(args.trees, trees, step_s, strict=True):
            rows.append({"method": method, "heads": heads, "tree": name, "nodes": tree.num_nodes,
                         "step_ms": s * 1e3, "ar_step_ms": ar_s * 1e3, "step_vs_ar": s / ar_s})
    lines = [f"model: {model}; batch 1; {args.new_tokens} new tokens; median of {args.runs} runs; backend: "
             f"{jax.default_backend()}", "",
             "| method | heads | tree | nodes | step ms | AR step ms | step / AR step |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['heads']} | {r['tree']} | {r['nodes']} | {r['step_ms']:.3f} | "
              f"{r['ar_step_ms']:.3f} | {r['step_vs_ar']:.2f} |" for r in rows]
    write_report(args.out, "step_time", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
