"""AR vs speculative decoding on a memory-bound CPU target, with an oracle drafter whose accuracy is fixed: the
speed-up a tree can give on this machine at a given draft accuracy.

    python -m amphista_jax.evals.benchmarks.oracle_curve [--sizes 150m 500m] [--p-right 0.6 0.8 0.9]
        [--trees chain-4 small-8 small-16 mc_sim_7b_63] [--new-tokens 64] [--runs 2] [--out runs/benchmarks]

Each size is a random-init Llama (`common.SIZES`; fp32 by default; decoding's `split_layers` layout), large
enough that its step reads far more weight bytes than this CPU's caches hold. The oracle (`OracleDrafter`) knows
the target's greedy continuation (AR runs first) and makes each tree node right with probability `p_right`,
independently, and otherwise a wrong token distinct from its siblings': a chain then accepts depth d with
probability `p_right ** d`, and a node with k children is right at least once with probability `1 - (1 - p_right) ** k`.
Its propose is a gather, so each row measures the target's verify cost against its AR step, which is what a
tree costs on this machine for a drafter of that accuracy. Greedy, batch 1; the speculative tokens are checked
equal to AR's. Tokens/s are medians of `--runs` timed runs after a warm-up, all in one run of this script.
Writes `oracle_curve.json`, `.md` and `.png` to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from amphista_jax.drafters.base import DraftContext, Drafter, Proposal
from amphista_jax.engine.decode import generate, pad_prompts, speculative_generate
from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.evals.benchmarks.common import SIZES, median_seconds, model_config, random_target, write_report
from amphista_jax.infra.errors import UserError
from amphista_jax.infra.figures import pyplot, save_figure
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.target import Target
from amphista_jax.trees.names import get_tree
from amphista_jax.trees.tree import TreeSpec, batched, tree_arrays

TREES = ("chain-4", "small-8", "small-16", "mc_sim_7b_63")


@dataclasses.dataclass(frozen=True)
class OracleDrafter(Drafter):
    """Drafts from the target's known greedy continuation (`draft_params` = `[B, W]` reference rows: prompt, then
    AR's tokens): each node of a static tree is right with probability `p_right`, else `right + 1 + rank`
    (mod V), a wrong token that no sibling repeats."""

    name = "oracle"
    p_right: float
    vocab_size: int

    def init(self, rng: jax.Array, target: Target) -> jax.Array:
        raise NotImplementedError("the oracle's params are its reference rows")

    def param_trees(self, target: Target) -> tuple[Any, ...]:
        return ()  # given token rows: no param layout to check

    def loss(self, params: jax.Array, target: Target, batch: dict, target_out: Any) -> tuple[jax.Array, dict]:
        raise NotImplementedError("the oracle is not trained")

    def propose(self, params: jax.Array, target: Any, ctx: DraftContext, tree: TreeSpec, rng: jax.Array) -> Proposal:
        arrays = batched(tree_arrays(tree), ctx.root.shape[0])
        positions = jnp.minimum(ctx.lengths[:, None] + arrays.depth, params.shape[1] - 1)  # [B, N]
        right = jnp.take_along_axis(params, positions, axis=1)
        wrong = (right + 1 + arrays.rank) % self.vocab_size
        tokens = jnp.where(jax.random.bernoulli(rng, self.p_right, right.shape), right, wrong)
        return Proposal(tokens.at[:, 0].set(ctx.root), arrays)


def bench(model: str, config: ModelConfig, dtype: str, p_rights: list[float], trees: dict[str, TreeSpec],
          new_tokens: int, runs: int, prompt_len: int) -> list[dict]:
    """AR, then every (p_right, tree) on one random prompt, for a random-init `config` named `model`.
    `step / AR step` divides each side's wall time (prefill included) by its decoding steps."""
    params = random_target(config, dtype)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    prompt = np.random.RandomState(0).randint(3, config.vocab_size, (1, prompt_len))
    tokens, lengths = pad_prompts(prompt.tolist())
    cache = max(DecodeSpec(config, OracleDrafter(1.0, config.vocab_size), tree, new_tokens).cache_size(tokens.shape[1])
                for tree in trees.values())  # one cache for AR and every tree
    ar = functools.partial(generate, params, tokens, lengths, jax.random.key(0), config=config,
                           max_new_tokens=new_tokens, cache_size=cache)
    ar_out, ar_compile = _first_call(ar)
    ar_s = median_seconds(lambda: jax.block_until_ready(ar()), runs)
    base = {"model": model, "parameters": n_params, "dtype": dtype, "new_tokens": new_tokens, "runs": runs}
    rows = [base | {"method": "ar", "tree": "-", "nodes": 1, "p_right": None, "tau": 1.0,
                    "tokens_per_s": new_tokens / ar_s, "speedup": 1.0, "same_as_ar": True, "compile_s": ar_compile}]
    reference = jnp.concatenate([jnp.asarray(prompt, jnp.int32), ar_out.tokens], axis=1)  # [1, T + new_tokens]
    for p_right, name in tqdm(list(itertools.product(p_rights, trees)), desc=model, unit="tree"):
        spec = functools.partial(speculative_generate, params, reference, tokens, lengths, jax.random.key(1),
                                 config=config, drafter=OracleDrafter(p_right, config.vocab_size), tree=trees[name],
                                 max_new_tokens=new_tokens, cache_size=cache)
        out, compile_s = _first_call(spec)
        spec_s = median_seconds(lambda spec=spec: jax.block_until_ready(spec()), runs)
        steps = int(out.row_steps[0])
        rows.append(base | {"method": "oracle", "tree": name, "nodes": trees[name].num_nodes, "p_right": p_right,
                            "tau": float(out.tau[0]), "tokens_per_s": new_tokens / spec_s,
                            "speedup": ar_s / spec_s, "step_over_ar_step": spec_s / steps / (ar_s / (new_tokens - 1)),
                            "same_as_ar": bool(np.array_equal(np.asarray(out.tokens), np.asarray(ar_out.tokens))),
                            "compile_s": compile_s})
    return rows


def _first_call(fn: Any) -> tuple[Any, float]:
    """(output, seconds) of the first call: compilation plus one run."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def table(rows: list[dict]) -> str:
    lines = ["| model | params | dtype | tree | nodes | p_right | tau | tokens/s | speed-up vs AR | step / AR step | "
             "same as AR |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = "-" if r["p_right"] is None else f"{r['p_right']:.2f}"
        slower = " (slower)" if r["speedup"] < 1 else ""
        ratio = f"{r['step_over_ar_step']:.2f}" if "step_over_ar_step" in r else "1.00"
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.0f}M | {r['dtype']} | {r['tree']} | "
                     f"{r['nodes']} | {p} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x{slower} | "
                     f"{ratio} | {r['same_as_ar']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Speed-up over AR against tree size, one line per (model, p_right)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    spec_rows = [r for r in rows if r["method"] == "oracle"]
    for (model, p_right), group in itertools.groupby(sorted(spec_rows, key=lambda r: (r["model"], r["p_right"],
                                                                                      r["nodes"])),
                                                     key=lambda r: (r["model"], r["p_right"])):
        group = list(group)
        ax.plot([r["nodes"] - 1 for r in group], [r["speedup"] for r in group], marker="o",
                label=f"{model}, p_right {p_right:.2f}")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("draft nodes in the tree")
    ax.set_ylabel("speed-up over AR (measured)")
    ax.set_title("Oracle drafter on a CPU target: speed-up by tree size")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["150m", "500m"], choices=list(SIZES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--p-right", nargs="+", type=float, default=[0.6, 0.8, 0.9])
    parser.add_argument("--trees", nargs="+", default=list(TREES))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--out", default="runs/benchmarks")
    args = parser.parse_args()
    bad = [p for p in args.p_right if not 0.0 <= p <= 1.0]
    if bad:
        parser.error(f"--p-right {bad}: each must be a probability in [0, 1]")
    trees = {}
    for name in args.trees:
        try:
            trees[name] = get_tree(name)
        except UserError as e:
            parser.error(f"--trees {name}: {e}")
        if not isinstance(trees[name], TreeSpec):
            parser.error(f"--trees {name}: the oracle fills static trees only (a preset or a JSON file of paths)")
    rows = []
    for size in args.sizes:
        rows += bench(f"llama-{size}", model_config(size), args.dtype, args.p_right, trees, args.new_tokens,
                      args.runs, args.prompt_len)
    write_report(args.out, "oracle_curve", {"backend": jax.default_backend(), "rows": rows}, table(rows))
    plot(rows, Path(args.out) / "oracle_curve.png")


if __name__ == "__main__":
    main()
