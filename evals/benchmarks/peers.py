"""Peers beside us: the same target, prompts and greedy rule decoded by the reference implementations on the package
index and by us, in one run, interleaved; and which of our shipped head sets the reference layouts can hold.

    pip install -e ".[peers]" && pip install --no-deps --require-hashes -r tests/reference-packages.txt
    python -m amphista_jax.evals.benchmarks.peers [--prompts 20] [--max-new-tokens 128] [--methods eagle3]
        [--engines medusa eagle dflash] [--medusa-heads DIR] [--eagle-heads DIR] [--dflash-heads DIR]
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

The reference engines (`evals/peer_engines`: medusa-llm's `medusa_generate` on its `[1, 7, 6]` tree, eagle-llm's
`eagenerate` on its 26-node tree, dflash's `dflash_generate` on a chain through its block) each decode `--<engine>-
heads` written in the engine's layout over the whole vocabulary (`export_heads(..., widen=True)`), and ours decodes
those same files read back (`published.READERS`) on the same tree: per engine, on how many prompts both committed the
same number of tokens at every verify step, our tau minus theirs, and our tokens/s over theirs. Defaults: the shipped
Medusa heads, and the EAGLE and DFlash heads of `configs/{eagle,dflash}/smollm2-reference-form.yaml` (a missing one
is one line naming its config). The export matrix tries every shipped head set in every `convert --heads-to` layout
(`drafters/exported.py`) and records what was written or why it was refused. Writes `peers.{json,md}` under `--out`,
naming the machine.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from amphista_jax.assets import shipped_heads_root
from amphista_jax.drafters.base import Drafter
from amphista_jax.drafters.exported import LAYOUTS, ExportError, export_heads
from amphista_jax.drafters.io import load_draft
from amphista_jax.drafters.published import READERS
from amphista_jax.evals.benchmarks.common import benchmark_parser, write_report
from amphista_jax.evals.datasets import DatasetConfig, load_prompts
from amphista_jax.facade.drafter_source import load_draft_params, read_source
from amphista_jax.facade.generator import Generator
from amphista_jax.infra.machine import this_machine
from amphista_jax.models.fetch import resolve_data, resolve_model
from amphista_jax.models.target import Target
from amphista_jax.trees.names import PRESET_DIR

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
        seconds = time.perf_counter() - t0 - out.compile_seconds
        accepted = [int(a) for a in np.asarray(out.output.accept_lengths)[0] if a > 0]
        return {"ids": out.token_ids[0], "seconds": seconds, "tau": out.tau[0], "accept_lengths": accepted}


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


@dataclasses.dataclass(frozen=True)
class Engine:
    """A reference engine beside ours: its package (and the name it imports as), its side in `evals/peer_engines`,
    our heads' layout it loads, the tree both sides decode on, where our heads come from by default, and the config
    that trains them."""

    package: str
    module: str
    side: str
    layout: str
    tree: str
    heads: str
    config: str


# The engines' own trees (`assets/trees`, read from the packages): eagle-llm 1.2.1's static EAGLE-1 tree (its
# `choices.mc_sim_7b_63`: 25 draft nodes and the root) and medusa-llm 0.1's `medusa_choices=[1, 7, 6]` (the target's
# token, 7 of head 0's candidates, and 6 of head 1's under each of them).
ENGINES = {
    "medusa": Engine("medusa-llm", "medusa", "MedusaSide", "medusa", str(PRESET_DIR / "medusa_llm_1_7_6.json"),
                     str(shipped_heads_root("smollm2") / "medusa"), "configs/medusa/smollm2.yaml"),
    "eagle": Engine("eagle-llm", "eagle", "EagleSide", "eagle", str(PRESET_DIR / "eagle_llm_26.json"),
                    "runs/smollm2/eagle-reference-form/heads", "configs/eagle/smollm2-reference-form.yaml"),
    "dflash": Engine("dflash", "dflash", "DFlashSide", "dflash", "chain-7", "runs/smollm2/dflash-reference-form/heads",
                     "configs/dflash/smollm2-reference-form.yaml"),
}


def engine_side(name: str, model_dir: str, heads: Path) -> Callable[[list[int], int], dict[str, Any]]:
    """The reference engine `name`'s own generation loop on `heads` (in its layout)."""
    module = importlib.import_module(f"amphista_jax.evals.peer_engines.{name}")
    return getattr(module, ENGINES[name].side)(model_dir, str(heads))


def heads_pair(name: str, heads: str, gen: Generator, work: Path) -> tuple[Path, Drafter, dict]:
    """(the directory of `heads` written in engine `name`'s layout over the whole vocabulary, in fp32; those files
    read back as our drafter and its params): both sides decode the very same files."""
    fmt = ENGINES[name].layout
    target = Target(gen.config, gen.params)
    _, drafter, params = load_draft(heads, gen.config, gen.params)
    theirs = work / f"{name}-{fmt}"
    theirs.mkdir(parents=True)
    export_heads(fmt, drafter, params, target, theirs, str(Path(gen.model_dir).absolute()), widen=True)
    return theirs, *READERS[fmt](theirs, target)


def check_engines(names: list[str], heads: dict[str, str], model_dir: str) -> None:
    """One line naming the fix, before anything slow: an engine whose package or heads are missing."""
    for name in names:
        engine = ENGINES[name]
        if importlib.util.find_spec(engine.module) is None:
            raise SystemExit(f"error: --engines {name}: {engine.package} is not installed: pip install --no-deps "
                             "--require-hashes -r tests/reference-packages.txt")
        if not (Path(heads[name]) / "draft.json").is_file():
            raise SystemExit(f"error: --{name}-heads {heads[name]}: no heads there; train them with `amphista-jax "
                             f"train --config {engine.config}`, or leave {name} out of --engines")


def agreement(theirs: list[dict], ours: list[dict]) -> dict[str, Any]:
    """Per prompt, whether both sides committed the same number of tokens at every verify step."""
    same = [a["accept_lengths"] == b["accept_lengths"] for a, b in zip(theirs, ours, strict=True)]
    return {"equal_accept_lengths": sum(same), "prompts": len(same),
            "tau_difference": float(np.mean([a["tau"] for a in ours]) - np.mean([a["tau"] for a in theirs]))}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="*", default=["eagle3"])
    parser.add_argument("--engines", nargs="*", default=list(ENGINES), choices=list(ENGINES))
    for name, engine in ENGINES.items():
        parser.add_argument(f"--{name}-heads", default=engine.heads,
                            help=f"our heads for {engine.package}'s engine (default: {engine.heads})")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()
    model_dir = resolve_model(args.model or "smollm2")
    heads = {name: getattr(args, f"{name}_heads") for name in args.engines}
    check_engines(args.engines, heads, model_dir)
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
    pairs = {}
    with tempfile.TemporaryDirectory(prefix="peers-") as work:
        for name in args.engines:
            theirs, drafter, params = heads_pair(name, heads[name], ar, Path(work))
            tree = ENGINES[name].tree
            label = Path(tree).stem
            pairs[name] = (f"{ENGINES[name].package} ({label})", f"ours {name} ({label})")
            sides[pairs[name][0]] = engine_side(name, model_dir, theirs)
            sides[pairs[name][1]] = OurSide(ar.with_drafter(drafter, tree, draft_params=params))
        runs = run_interleaved(sides, prompts, args.max_new_tokens, args.threads)
    best, threads = runs.pop("threads")
    greedy = [r["ids"] for r in runs["ours AR"]]
    rows = []
    for name, done in runs.items():
        tokens, seconds = sum(len(r["ids"]) for r in done), sum(r["seconds"] for r in done)
        taus = [r["tau"] for r in done if r["tau"] is not None]
        rows.append({"side": name, "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": tokens / seconds,
                     "tau": float(np.mean(taus)) if taus else None,
                     "equal_to_greedy": sum(r["ids"] == g for r, g in zip(done, greedy, strict=True))})
    rate = {r["side"]: r["tokens_per_s"] for r in rows}
    engines = {name: agreement(runs[t], runs[o]) | {"speedup_over_engine": rate[o] / rate[t]}
               for name, (t, o) in pairs.items()}
    found = versions()
    lines = [f"Peers on {Path(model_dir).name} (fp32): {len(prompts)} MT-Bench first turns, batch 1, greedy, "
             f"{args.max_new_tokens} new tokens at most, interleaved; torch at {best} thread(s) (measured: "
             + ", ".join(f"{n}: {r:.1f} tokens/s" for n, r in threads.items()) + "), XLA at its default. "
             f"Versions: {', '.join(f'{k} {v}' for k, v in found.items() if v)}. Machine: {this_machine().describe()}.",
             f"`python -m amphista_jax.evals.benchmarks.peers --prompts {len(prompts)} --max-new-tokens "
             f"{args.max_new_tokens} --methods {' '.join(args.methods)} --engines {' '.join(args.engines)}`", "",
             "| side | tokens/s | x ours AR | tau | equal to greedy AR |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['side']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / rate['ours AR']:.2f} | "
              f"{'-' if r['tau'] is None else format(r['tau'], '.2f')} | {r['equal_to_greedy']}/{len(prompts)} |"
              for r in rows]
    if engines:
        lines += ["", "The same heads (written in the engine's layout, read back as ours) and tree on both sides:", "",
                  "| engine | heads | prompts with equal accept lengths at every step | our tau - theirs | "
                  "our tokens/s / theirs |", "|---|---|---:|---:|---:|"]
        lines += [f"| {ENGINES[n].package} | {heads[n]} | {e['equal_accept_lengths']}/{e['prompts']} | "
                  f"{e['tau_difference']:+.3f} | {e['speedup_over_engine']:.2f}x |" for n, e in engines.items()]
    lines += ["", "Shipped head sets in the reference layouts (`convert --heads-to`):", "",
              "| heads | " + " | ".join(LAYOUTS) + " |", "|---|" + "---|" * len(LAYOUTS)]
    lines += [f"| {m} | " + " | ".join(cells.values()) + " |" for m, cells in matrix.items()]
    write_report(args.out, "peers", {"rows": rows, "engines": engines, "heads": heads, "export_matrix": matrix,
                                     "threads": threads, "versions": found, "prompts": len(prompts),
                                     "max_new_tokens": args.max_new_tokens, "model": model_dir,
                                     "accept_lengths": {n: [r["accept_lengths"] for r in runs[n]]
                                                        for pair in pairs.values() for n in pair},
                                     "machine": this_machine().describe()}, "\n".join(lines))


def run_interleaved(sides: dict[str, Any], prompts: list[list[int]], max_new_tokens: int, choices: list[int]
                    ) -> dict[str, Any]:
    """torch's thread count measured on the first prompt (transformers' greedy), every side warmed up on it, then
    each prompt through every side, the order rotating from prompt to prompt. Returns each side's runs, and under
    "threads" (the count chosen, the rates measured)."""
    threads = best_threads(sides["transformers greedy"], prompts[0], max_new_tokens, choices)
    for side in sides.values():  # warm-up: compiles ours
        side(prompts[0], max_new_tokens)
    runs: dict[str, Any] = {name: [] for name in sides}
    names = list(sides)
    for i, ids in enumerate(tqdm(prompts, desc="peers, interleaved", unit="prompt")):
        for name in names[i % len(names):] + names[: i % len(names)]:
            runs[name].append(sides[name](ids, max_new_tokens))
    return runs | {"threads": threads}


if __name__ == "__main__":
    main()
