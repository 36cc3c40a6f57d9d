"""Peers beside us: the same target, prompts and greedy rule decoded by the reference implementations on the package
index and by us, in one run, interleaved; and which of our shipped head sets the reference layouts can hold.

    pip install -e ".[peers]" && pip install --no-deps --require-hashes -r tests/reference-packages.txt
    python -m amphista_jax.evals.benchmarks.peers [--prompts 20] [--max-new-tokens 128] [--methods eagle3]
        [--engines medusa eagle dflash] [--medusa-heads DIR] [--eagle-heads DIR] [--dflash-heads DIR]
        [--threads 1 2] [--out docs/results/peers]
    python -m amphista_jax.evals.benchmarks.peers --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \
        --dataset humaneval [--draft-trees auto chain-7] [--temperature 1] --out docs/results/qwen-pair/peers

The target is SmolLM2-135M-Instruct (or `--model`) in fp32 on both sides (fetched on first use); the prompts are the
first `--prompts` MT-Bench first turns (or HumanEval tasks: `--dataset humaneval`) through its chat template, batch 1,
greedy, or sampled at `--temperature` (transformers over the whole distribution: `top_k=0`, `top_p=1`, as ours).
Sides: transformers' `generate`, its prompt lookup (`prompt_lookup_num_tokens=10`, its n-gram drafter) and, with a
`--draft-model`, its assisted generation with that model (`assistant_model=`, its own draft-length schedule); ours:
AR, prompt lookup on a 10-token chain, each `--methods` shipped head set on the tree `--tree auto` picks here, and the
draft model on each of `--draft-trees` (one copy of its params shared by them). Every side decodes the first
prompt once untimed (compiling ours); then each prompt runs every side in turn, the order rotating from prompt to
prompt. Each call is timed by the wall clock around it (tokenised ids in, ids out; the compile of a prompt length
ours has not met yet is taken out). torch runs at the fastest of
`--threads` for `set_num_threads`, measured on the warm-up prompt (stated); XLA at its default. For each side:
tokens/s, tau where the side counts it (ours: tokens per target forward), and on how many prompts its tokens equal
ours AR's (the greedy reference; transformers' greedy is checked against it too; sampled runs are not compared: a
sampled decode's losslessness is a distribution test, `tests/test_speculative.py`).

The reference engines (`evals/peer_engines`: medusa-llm's `medusa_generate` on its `[1, 7, 6]` tree, eagle-llm's
`eagenerate` on its 26-node tree, dflash's `dflash_generate` on a chain through its block) each decode `--<engine>-
heads` written in the engine's layout over the whole vocabulary (`export_heads(..., widen=True)`), and ours decodes
those same files read back (`published.READERS`) on the same tree: per engine, on how many prompts both committed the
same number of tokens at every verify step, our tau minus theirs, and our tokens/s over theirs. Defaults: the shipped
Medusa heads, and the EAGLE and DFlash heads of `configs/{eagle,dflash}/smollm2-reference-form.yaml` (a missing one
is one line naming its config). The export matrix tries every shipped head set in every `convert --heads-to` layout
(`drafters/exported.py`) and records what was written or why it was refused. Engines, their heads and the export
matrix are SmolLM2's: with another `--model` they are left out unless named. Writes `peers.{json,md}` under `--out`,
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


def torch_model(model_dir: str) -> Any:
    """transformers' model of a checkpoint directory, fp32, in eval mode (loaded once, shared by the torch sides)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class TorchSide:
    """transformers' `generate` on the same checkpoint, greedy or sampled at `temperature` over the whole
    distribution, plainly, with its prompt lookup (`lookup` tokens) or assisted by `assistant` (a draft model)."""

    def __init__(self, model: Any, temperature: float, lookup: int = 0, assistant: Any = None) -> None:
        import torch

        self.torch, self.model = torch, model
        self.extra: dict[str, Any] = {"do_sample": False} if temperature == 0 else {
            "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        self.extra |= {"prompt_lookup_num_tokens": lookup} if lookup else {}
        self.extra |= {"assistant_model": assistant} if assistant is not None else {}

    def __call__(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        self.torch.manual_seed(0)
        with self.torch.no_grad():
            t0 = time.perf_counter()
            out = self.model.generate(self.torch.as_tensor([ids]), max_new_tokens=max_new_tokens, **self.extra)
            seconds = time.perf_counter() - t0
        return {"ids": out[0, len(ids):].tolist(), "seconds": seconds, "tau": None}


class OurSide:
    def __init__(self, gen: Generator, temperature: float = 0.0) -> None:
        self.gen, self.temperature = gen, temperature

    def __call__(self, ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        # a new prompt-length bucket compiles: not timed
        out = self.gen.generate(ids, max_new_tokens=max_new_tokens, temperature=self.temperature)
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


DATASETS = {"mt-bench": "MT-Bench first turns", "humaneval": "HumanEval tasks"}


def check_sides(args: Any, model_dir: str) -> tuple[list[str], list[str]]:
    """(the engines, the shipped methods) to run, in one line naming the fix before anything slow: engines and the
    export matrix are SmolLM2's (their default only there), each named engine's package and heads must be here."""
    smollm2 = Path(model_dir).name == "smollm2"
    engines = list(ENGINES) if args.engines is None and smollm2 else args.engines or []
    methods = ["eagle3"] if args.methods is None and smollm2 else args.methods or []
    if engines and not smollm2:
        raise SystemExit(f"error: --engines {' '.join(engines)}: the engines decode SmolLM2's heads; with --model "
                         f"{args.model} leave --engines out")
    check_engines(engines, {name: getattr(args, f"{name}_heads") for name in engines}, model_dir)
    return engines, methods


def draft_model_sides(ar: Generator, name: str, trees: list[str], temperature: float) -> dict[str, OurSide]:
    """Ours with the draft model `name` on each of `trees` (one copy of its params, shared by the target's
    attachments of it)."""
    views = [ar.with_drafter(name, tree).for_batch(1) for tree in trees]
    return {f"ours {Path(str(view.heads_dir)).name} ({view.tree_name})": OurSide(view, temperature) for view in views}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dataset", choices=list(DATASETS), default="mt-bench")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--methods", nargs="*", default=None, help="shipped head sets (default: eagle3 on SmolLM2)")
    parser.add_argument("--draft-model", default=None, help="a draft model (its directory or fetched name)")
    parser.add_argument("--draft-trees", nargs="+", default=["auto", "chain-7"])
    parser.add_argument("--engines", nargs="*", default=None, choices=list(ENGINES),
                        help="reference engines (default: all, on SmolLM2)")
    for name, engine in ENGINES.items():
        parser.add_argument(f"--{name}-heads", default=engine.heads,
                            help=f"our heads for {engine.package}'s engine (default: {engine.heads})")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    args = parser.parse_args()
    if args.temperature < 0:
        raise SystemExit(f"error: --temperature {args.temperature}: 0 (greedy) or more")
    model_dir = resolve_model(args.model or "smollm2")
    engines, methods = check_sides(args, model_dir)
    heads = {name: getattr(args, f"{name}_heads") for name in engines}
    temperature = args.temperature
    ar = Generator.load(model_dir)
    dataset = DatasetConfig("mt_bench", resolve_data("mt-bench"), limit=args.prompts, turns=1) \
        if args.dataset == "mt-bench" else DatasetConfig("humaneval", limit=args.prompts)
    data, _ = load_prompts(dataset)
    prompts = [ar.encode(p.turns[0], chat=True) for p in data]
    shipped = ["eagle3", "eagle", "medusa", "amphista", "sar", "bita"]
    matrix = export_matrix(ar, shipped) if engines or methods else {}

    torch_target = torch_model(model_dir)
    sides: dict[str, Any] = {"transformers": TorchSide(torch_target, temperature),
                             "transformers prompt lookup": TorchSide(torch_target, temperature, lookup=10)}
    if args.draft_model:
        assistant = torch_model(str(resolve_model(args.draft_model)))
        sides["transformers assisted"] = TorchSide(torch_target, temperature, assistant=assistant)
    sides |= {"ours AR": OurSide(ar, temperature),
              "ours prompt lookup (chain-10)": OurSide(ar.with_drafter("prompt_lookup", "chain-10"), temperature)}
    for method in methods:
        sides[f"ours {method} (auto)"] = OurSide(ar.with_drafter(method, "auto").for_batch(1), temperature)
    if args.draft_model:
        sides |= draft_model_sides(ar, args.draft_model, args.draft_trees, temperature)
    pairs = {}
    with tempfile.TemporaryDirectory(prefix="peers-") as work:
        for name in engines:
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
                     "equal_to_greedy": None if temperature else
                     sum(r["ids"] == g for r, g in zip(done, greedy, strict=True))})
    rate = {r["side"]: r["tokens_per_s"] for r in rows}
    engines_found = {name: agreement(runs[t], runs[o]) | {"speedup_over_engine": rate[o] / rate[t]}
                     for name, (t, o) in pairs.items()}
    found = versions()
    rule = "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}"
    command = (f"`python -m amphista_jax.evals.benchmarks.peers --model {Path(model_dir).name} --dataset "
               f"{args.dataset} --prompts {len(prompts)} --max-new-tokens {args.max_new_tokens} --temperature "
               f"{temperature:g}" + (f" --methods {' '.join(methods)}" if methods else "")
               + (f" --draft-model {args.draft_model} --draft-trees {' '.join(args.draft_trees)}"
                  if args.draft_model else "") + (f" --engines {' '.join(engines)}" if engines else "") + "`")
    lines = [f"Peers on {Path(model_dir).name} (fp32): {len(prompts)} {DATASETS[args.dataset]} through the chat "
             f"template, batch 1, {rule}, {args.max_new_tokens} new tokens at most, interleaved; torch at {best} "
             "thread(s) (measured: " + ", ".join(f"{n}: {r:.1f} tokens/s" for n, r in threads.items())
             + "), XLA at its default. "
             f"Versions: {', '.join(f'{k} {v}' for k, v in found.items() if v)}. Machine: {this_machine().describe()}.",
             command, "",
             "| side | tokens/s | x ours AR | tau | equal to greedy AR |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['side']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / rate['ours AR']:.2f} | "
              f"{'-' if r['tau'] is None else format(r['tau'], '.2f')} | {equal} |"
              for r in rows for equal in ["-" if r["equal_to_greedy"] is None
                                          else f"{r['equal_to_greedy']}/{len(prompts)}"]]
    if engines_found:
        lines += ["", "The same heads (written in the engine's layout, read back as ours) and tree on both sides:", "",
                  "| engine | heads | prompts with equal accept lengths at every step | our tau - theirs | "
                  "our tokens/s / theirs |", "|---|---|---:|---:|---:|"]
        lines += [f"| {ENGINES[n].package} | {heads[n]} | {e['equal_accept_lengths']}/{e['prompts']} | "
                  f"{e['tau_difference']:+.3f} | {e['speedup_over_engine']:.2f}x |" for n, e in engines_found.items()]
    if matrix:
        lines += ["", "Shipped head sets in the reference layouts (`convert --heads-to`):", "",
                  "| heads | " + " | ".join(LAYOUTS) + " |", "|---|" + "---|" * len(LAYOUTS)]
        lines += [f"| {m} | " + " | ".join(cells.values()) + " |" for m, cells in matrix.items()]
    write_report(args.out, "peers", {"rows": rows, "engines": engines_found, "heads": heads, "export_matrix": matrix,
                                     "threads": threads, "versions": found, "prompts": len(prompts),
                                     "dataset": args.dataset, "temperature": temperature,
                                     "max_new_tokens": args.max_new_tokens, "model": model_dir,
                                     "accept_lengths": {n: [r["accept_lengths"] for r in runs[n]]
                                                        for pair in pairs.values() for n in pair},
                                     "machine": this_machine().describe()}, "\n".join(lines))


def run_interleaved(sides: dict[str, Any], prompts: list[list[int]], max_new_tokens: int, choices: list[int]
                    ) -> dict[str, Any]:
    """torch's thread count measured on the first prompt (transformers' plain `generate`), every side warmed up on
    it, then each prompt through every side (sampling sides seeded alike for every call), the order rotating from
    prompt to prompt. Returns each side's runs, and under "threads" (the count chosen, the rates measured)."""
    threads = best_threads(sides["transformers"], prompts[0], max_new_tokens, choices)
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
