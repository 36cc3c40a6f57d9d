"""Peers beside us: the same target, prompts and greedy rule decoded by the reference implementations on the package
index and by us, in one run, interleaved; and which of our shipped head sets the reference layouts can hold.

    pip install -e ".[peers]" && pip install --no-deps --require-hashes -r tests/reference-packages.txt
    python -m amphista_jax.evals.benchmarks.peers [--prompts 20] [--max-new-tokens 128] [--methods eagle3]
        [--threads 1 2] [--out docs/results/peers]

The target is SmolLM2-135M-Instruct in fp32 on both sides (fetched on first use); the prompts are the first
`--prompts` MT-Bench first turns through its chat template, batch 1, greedy. Sides: transformers' greedy `generate`
and its prompt lookup (`prompt_lookup_num_tokens=10`, its n-gram drafter); ours: AR, prompt lookup on a 10-token
chain, and each `--methods` shipped head set on the tree `--tree auto` picks here. Every side decodes the first
prompt once untimed (compiling ours); then each prompt runs every side in turn, the order rotating from prompt to
prompt. Each call is timed by the wall clock around it (tokenised ids in, ids out; the compile of a prompt length
ours has not met yet is taken out). torch runs at the fastest of
`--threads` for `set_num_threads`, measured on the warm-up prompt (stated); XLA at its default. For each side:
tokens/s, tau where the side counts it (ours: tokens per target forward), and on how many prompts its tokens equal
ours AR's (the greedy reference; transformers' greedy is checked against it too).

The reference engines (medusa-llm's `medusa_generate`, eagle-llm's `eagenerate`, dflash's `spec_generate`) decode
heads in their own layouts. The export matrix tries every shipped head set in every `convert --heads-to` layout
(`drafters/exported.py`) and records what was written or why it was refused; an engine side needs a head set its
layout holds. Writes `peers.{json,md}` under `--out`, naming the machine.
"""

from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from amphista_jax.drafters.exported import LAYOUTS, ExportError
from amphista_jax.evals.benchmarks.common import benchmark_parser, write_report
from amphista_jax.evals.datasets import DatasetConfig, load_prompts
from amphista_jax.facade.drafter_source import load_draft_params, read_source
from amphista_jax.facade.generator import Generator
from amphista_jax.models.fetch import resolve_data, resolve_model
from amphista_jax.models.target import Target

PEER_PACKAGES = ("torch", "transformers", "medusa-llm", "eagle-llm", "dflash", "speculators")


def export_matrix(gen: Generator, methods: list[str]) -> dict[str, dict[str, str]]:
    """Every shipped head set of `methods` in every reference layout: "written" or the one-line refusal."""
    target = Target(gen.config, gen.params)
    matrix = {}
    for method in methods:
        drafter, params = load_draft_params(read_source(method, gen.model_dir, gen.config), target, gen.model_dir,
                                            "float32")
        matrix[method] = {}
        for fmt, layout in LAYOUTS.items():
            try:
                layout(drafter, params, target, gen.model_dir)
                matrix[method][fmt] = "written"
            except ExportError as e:  # "--heads-to FMT: these M heads WHY; nothing was written" -> WHY
                why = str(e).split(": ", 1)[1].removesuffix("; nothing was written")
                matrix[method][fmt] = why.removeprefix(f"these {drafter.name} heads ")
    return matrix


class TorchSide:
    """transformers' `generate` on the same checkpoint, greedy, with or without its prompt lookup."""

    def __init__(self, model_dir: str, lookup: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.lookup = torch, lookup
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def __call__(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        extra = {"prompt_lookup_num_tokens": self.lookup} if self.lookup else {}
        with self.torch.no_grad():
            t0 = time.perf_counter()
            out = self.model.generate(self.torch.as_tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                      **extra)
            seconds = time.perf_counter() - t0
        return {"ids": out[0, len(ids):].tolist(), "seconds": seconds, "tau": None}


class OurSide:
    def __init__(self, gen: Generator) -> None:
        self.gen = gen

    def __call__(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        out = self.gen.generate(ids, max_new_tokens=max_new_tokens)  # a new prompt-length bucket compiles: not timed
        return {"ids": out.token_ids[0], "seconds": time.perf_counter() - t0 - out.compile_seconds, "tau": out.tau[0]}


def best_threads(side: TorchSide, ids: list[int], max_new_tokens: int, choices: list[int]
                 ) -> tuple[int, dict[int, float]]:
    """(the fastest `set_num_threads` choice, left set; tokens/s of `side` on `ids` at each choice)."""
    rates = {}
    for n in choices:
        side.torch.set_num_threads(n)
        run = side(ids, max_new_tokens)
        rates[n] = len(run["ids"]) / run["seconds"]
    best = max(rates, key=rates.get)
    side.torch.set_num_threads(best)
    return best, rates


def versions() -> dict[str, str | None]:
    found = {}
    for name in PEER_PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=["eagle3"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()
    model_dir = resolve_model(args.model or "smollm2")
    ar = Generator.load(model_dir)
    data, _ = load_prompts(DatasetConfig("mt_bench", resolve_data("mt-bench"), limit=args.prompts, turns=1))
    prompts = [ar.encode(p.turns[0], chat=True) for p in data]
    shipped = ["eagle3", "eagle", "medusa", "amphista", "sar", "bita"]
    matrix = export_matrix(ar, shipped)

    sides: dict[str, Any] = {"transformers greedy": TorchSide(model_dir, 0),
                             "transformers prompt lookup": TorchSide(model_dir, 10),
                             "ours AR": OurSide(ar),
                             "ours prompt lookup (chain-10)": OurSide(ar.with_drafter("prompt_lookup", "chain-10"))}
    for method in args.methods:
        sides[f"ours {method} (auto)"] = OurSide(ar.with_drafter(method, "auto").for_batch(1))
    best, threads = best_threads(sides["transformers greedy"], prompts[0], args.max_new_tokens, args.threads)
    for side in sides.values():  # warm-up: compiles ours
        side(prompts[0], args.max_new_tokens)
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    names = list(sides)
    for i, ids in enumerate(tqdm(prompts, desc="peers, interleaved", unit="prompt")):
        for name in names[i % len(names):] + names[: i % len(names)]:
            runs[name].append(sides[name](ids, args.max_new_tokens))
    greedy = [r["ids"] for r in runs["ours AR"]]
    rows = []
    for name, done in runs.items():
        tokens, seconds = sum(len(r["ids"]) for r in done), sum(r["seconds"] for r in done)
        taus = [r["tau"] for r in done if r["tau"] is not None]
        rows.append({"side": name, "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": tokens / seconds,
                     "tau": float(np.mean(taus)) if taus else None,
                     "equal_to_greedy": sum(r["ids"] == g for r, g in zip(done, greedy, strict=True))})
    ar_rate = next(r["tokens_per_s"] for r in rows if r["side"] == "ours AR")
    found = versions()
    lines = [f"Peers on {Path(model_dir).name} (fp32): {len(prompts)} MT-Bench first turns, batch 1, greedy, "
             f"{args.max_new_tokens} new tokens at most, interleaved; torch at {best} thread(s) (measured: "
             + ", ".join(f"{n}: {r:.1f} tokens/s" for n, r in threads.items()) + "), XLA at its default. "
             f"Versions: {', '.join(f'{k} {v}' for k, v in found.items() if v)}.",
             f"`python -m amphista_jax.evals.benchmarks.peers --prompts {len(prompts)} --max-new-tokens "
             f"{args.max_new_tokens} --methods {' '.join(args.methods)}`", "",
             "| side | tokens/s | x ours AR | tau | equal to greedy AR |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['side']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / ar_rate:.2f} | "
              f"{'-' if r['tau'] is None else format(r['tau'], '.2f')} | {r['equal_to_greedy']}/{len(prompts)} |"
              for r in rows]
    lines += ["", "Shipped head sets in the reference layouts (`convert --heads-to`):", "",
              "| heads | " + " | ".join(LAYOUTS) + " |", "|---|" + "---|" * len(LAYOUTS)]
    lines += [f"| {m} | " + " | ".join(cells.values()) + " |" for m, cells in matrix.items()]
    write_report(args.out, "peers", {"rows": rows, "export_matrix": matrix, "threads": threads, "versions": found,
                                     "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                                     "model": model_dir}, "\n".join(lines))


if __name__ == "__main__":
    main()
