"""Data-driven, hardware-aware draft trees: Medusa/Hydra's greedy construction priced by a measured step.

1. **Acceptance statistics.** `collect_rates` decodes calibration prompts (never the evaluation set) greedily
   with a *calibration tree* (every rank `0..R-1` at every depth, under the top-1 chain: BiTA's
   `efficient_tree`) and reads the per-(depth, rank) counts `speculative_generate` already keeps: `rates[d, r]`
   = P(the depth-`d+1` head's rank-`r` candidate is the target's token | the path to its parent was accepted).
2. **Growth.** `grow_trees` adds nodes one at a time, always the candidate with the largest path probability
   (the product of the rates along its path). Rates are <= 1, so a child never outranks its parent: every tree
   is prefix-closed, and tree `k` maximises the expected accept length `1 + sum(path probabilities)` over all
   trees of `k` draft nodes under the model's independence assumption.
3. **Price.** `measure_step_seconds` times the real decode loop of this drafter on this device for a grid of
   sizes; `pick` prices them by the tree plan's rule (`plan.decide`, as `auto` does): the size with the most
   expected tokens per second, `tau(k) / step(k)`, against autoregressive decoding measured the same way.
4. **Per batch size.** Steps are priced at each batch size asked for (a verify forward of B x nodes tokens costs
   more, relative to an AR step of B tokens, as B grows), so the pick may shrink with the batch and, where no tree
   is predicted to beat AR by more than the rule's margin, be no speculation at all (`TreePolicy`, a policy file
   `--tree` takes). The picked tree's speed-up is also measured by decoding B calibration prompts with it and
   with AR.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from amphista_jax.choice.acceptance import (
    CANDIDATE_NODES,
    PROMPT_SETS,
    Acceptance,
    Candidate,
    candidate_trees,
    is_chat_target,
    mean_tau,
)
from amphista_jax.choice.plan import Decision, decide
from amphista_jax.choice.step_clock import StepClock
from amphista_jax.engine.decode import pad_prompts
from amphista_jax.facade.drafter_source import DrafterSource, read_source
from amphista_jax.facade.generator import Generator
from amphista_jax.infra.errors import UsageError, UserError
from amphista_jax.infra.figures import pyplot, save_figure
from amphista_jax.infra.machine import this_machine
from amphista_jax.infra.output_lock import write_atomic
from amphista_jax.trees.names import TreePolicy
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.tree import TreeSpec, efficient_tree


class TreeSearchError(UserError, ValueError):
    """Statistics that cannot grow a tree (heads whose drafts are never accepted)."""


DEFAULT_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 63)
DEFAULT_DEPTH = 5  # calibration depth for drafters that draft to any depth (EAGLE-2's trees reach 6)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)


def acceptance_rates(tries: np.ndarray, hits: np.ndarray) -> np.ndarray:
    """`[D, R]` hit / tried per (depth, rank) cell, summed over rows and prompts; 0 where never tried."""
    tries, hits = np.asarray(tries, np.float64), np.asarray(hits, np.float64)
    return np.divide(hits, tries, out=np.zeros_like(hits), where=tries > 0)


def grow_trees(rates: np.ndarray, max_nodes: int) -> list[tuple[TreeSpec, float]]:
    """(tree, expected accept length) for 1..`max_nodes` draft nodes, each the previous one plus its most
    probable candidate (ties broken by the path, so the result is deterministic). Stops early when every
    remaining candidate has probability 0."""
    rates = np.asarray(rates, np.float64)
    if rates.ndim != 2 or rates.size == 0 or ((rates < 0) | (rates > 1)).any():
        raise TreeSearchError(f"rates must be a non-empty [depth, ranks] array of probabilities, got {rates.shape}")
    depth, ranks = rates.shape
    heap = [(-rates[0, r], (r,)) for r in range(ranks)]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    tau, out = 1.0, []
    while heap and len(chosen) < max_nodes:
        neg_p, path = heapq.heappop(heap)
        if neg_p == 0:
            break
        chosen.append(path)
        tau -= neg_p
        out.append((TreeSpec(tuple(chosen)), tau))
        if len(path) < depth:
            for r in range(ranks):
                heapq.heappush(heap, (neg_p * rates[len(path), r], path + (r,)))
    return out


@dataclasses.dataclass(frozen=True)
class SearchResult:
    sizes: tuple[int, ...]  # draft nodes (root not counted) of the measured trees
    taus: tuple[float, ...]  # expected accept length of each
    step_seconds: tuple[float, ...]  # measured seconds per decode step of each
    ar_step_seconds: float
    decision: Decision  # the tree plan's rule on them

    @property
    def best(self) -> int:
        """Index into sizes of the tree with the most expected tokens per second (beating AR or not)."""
        return self.decision.best

    @property
    def tokens_per_second(self) -> tuple[float, ...]:
        return tuple(t / s for t, s in zip(self.taus, self.step_seconds, strict=True))

    @property
    def speedups(self) -> tuple[float, ...]:
        """Predicted speed-up over AR: expected tau x AR step / step (`plan.decide`)."""
        return self.decision.speedups


def pick(sizes: Sequence[int], taus: Sequence[float], step_seconds: Sequence[float], ar_step_seconds: float,
         batch: int = 1) -> SearchResult:
    """The sizes priced by the tree plan's rule (`plan.decide`): the best has the most expected tokens per second."""
    decision = decide(batch, taus, ar_step_seconds, step_seconds)
    return SearchResult(tuple(sizes), tuple(taus), tuple(step_seconds), ar_step_seconds, decision)


def tree_policy(results: dict[int, SearchResult], trees: Sequence[TreeSpec]) -> TreePolicy:
    """At each batch size, the tree the rule keeps (predicted to beat AR by more than its margin), else None (no
    speculation)."""
    return TreePolicy(tuple((b, None if r.decision.index is None else trees[r.decision.index])
                            for b, r in sorted(results.items())))


def greedy_outputs(gen: Generator, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int = 8,
                   progress: Callable[[int], None] | None = None) -> Iterator[tuple[Any, slice]]:
    """(output, its real rows) of greedy decoding of `prompts` with `gen` (its tree), `batch_size` at a time (a
    short last batch padded with one-token pad rows: one compile)."""
    tokens, lengths = pad_prompts(prompts, pad_id=gen.pad_id, multiple=64)
    spec = gen.spec(max_new_tokens, SamplingConfig())
    for i in range(0, len(prompts), batch_size):
        rows, lens = tokens[i: i + batch_size], lengths[i: i + batch_size]
        short = batch_size - len(rows)
        rows, lens = np.pad(rows, ((0, short), (0, 0)), constant_values=gen.pad_id), np.pad(lens, (0, short),
                                                                                            constant_values=1)
        yield gen.run(rows, lens, spec)[0], slice(0, batch_size - short)
        if progress:
            progress(batch_size - short)


def collect_rates(gen: Generator, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int = 8,
                  progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Summed `(node_tries, node_hits) [D, R]` of greedy speculative decoding of `prompts` with `gen`'s tree."""
    tries = hits = 0
    for out, keep in greedy_outputs(gen, prompts, max_new_tokens, batch_size, progress):
        tries = tries + np.asarray(out.node_tries)[keep].sum(0)
        hits = hits + np.asarray(out.node_hits)[keep].sum(0)
    return np.asarray(tries), np.asarray(hits)


def measured_tau(gen: Generator, prompts: Sequence[Sequence[int]], max_new_tokens: int, batch_size: int = 8,
                 progress: Callable[[int], None] | None = None) -> float:
    """Tokens per decode step of greedy decoding of `prompts` with `gen`'s tree, over all of them."""
    new, steps = [], []
    for out, keep in greedy_outputs(gen, prompts, max_new_tokens, batch_size, progress):
        new.append(np.asarray(out.num_tokens)[keep])
        steps.append(out.row_steps[keep])
    return mean_tau(np.concatenate(new), np.concatenate(steps))


HELD_OUT_PROMPT_TOKENS = 256  # calibration prompts longer than this are skipped


def calibration_prompts(gen: Generator, n: int, prompt_set: str | None = None) -> tuple[list[list[int]], str]:
    """(token ids of `n` calibration prompts, what they are in words), kept apart from training, regeneration and
    every evaluation set. `prompt_set` (default: `sharegpt` for a chat target, else `humaneval`): `sharegpt`, the
    last ShareGPT first turns (the first user turn of each conversation, from the end of the file) of at most
    `HELD_OUT_PROMPT_TOKENS` tokens (heads train on and answers are regenerated from the file's start), through
    the chat template; `humaneval`, HumanEval tasks 100 onwards (evaluations use the first ones), through the chat
    template for a chat target; `both`, half of each (the ShareGPT half rounded up), for a chat target that is
    asked code and prose alike."""
    from amphista_jax.prompts import humaneval_prompts

    chat = is_chat_target(gen.model_dir, gen.tokenizer)
    prompt_set = prompt_set or ("sharegpt" if chat else "humaneval")
    if prompt_set not in PROMPT_SETS or (prompt_set != "humaneval" and not chat):
        raise UsageError(f"calibration prompts {prompt_set!r}: choose one of {', '.join(PROMPT_SETS)} (ShareGPT's "
                         "need a chat target)")
    code = n // 2 if prompt_set == "both" else n if prompt_set == "humaneval" else 0
    ids = _sharegpt_prompts(gen, n - code)
    ids += [gen.encode(p, chat=chat) for p in humaneval_prompts(100, min(100 + code, 164))] if code else []
    where = {"sharegpt": "ShareGPT first turns from the end of the file (held out)",
             "humaneval": "HumanEval prompts from task 100",
             "both": "ShareGPT first turns from the end of the file (held out) and HumanEval prompts from task 100, "
                     "half each"}[prompt_set]
    return ids, where + (", through the chat template" if chat else "")


def _sharegpt_prompts(gen: Generator, n: int) -> list[list[int]]:
    """The token ids of the last `n` ShareGPT first turns of at most `HELD_OUT_PROMPT_TOKENS` tokens through the
    chat template, from the end of the file."""
    import json

    from amphista_jax.models.fetch import resolve_data

    ids: list[list[int]] = []
    if n == 0:
        return ids
    for line in reversed(Path(resolve_data("sharegpt")).read_text(encoding="utf-8").splitlines()):
        try:
            turns = json.loads(line).get("conversations") or []
        except (json.JSONDecodeError, AttributeError):
            continue
        text = next((t.get("value", "") for t in turns if isinstance(t, dict) and t.get("from") in ("human", "user")),
                    "")
        if text.strip() and len(prompt := gen.encode(text, chat=True)) <= HELD_OUT_PROMPT_TOKENS:
            ids.append(prompt)
        if len(ids) == n:
            break
    return ids


def measure_acceptance(gen: Generator, prompts: Sequence[Sequence[int]], max_new_tokens: int, measured_on: str, *,
                       ranks: int = 10, depth: int | None = None, batch_size: int = 8,
                       progress: Callable[[int], None] | None = None,
                       expect: Callable[[int], None] | None = None) -> Acceptance:
    """The acceptance statistics of `gen`'s drafter (`acceptance`): for a static-tree drafter the per-(depth, rank)
    rates on a calibration tree and the trees grown from them, then every candidate's tau measured by greedy
    decoding of `prompts`. `progress` counts prompts decoded; `expect` is told how many decodes there are in all
    once the candidates are known (after the rates' pass)."""
    drafter, vocab = gen.drafter, gen.config.vocab_size
    rates, grown, static = np.zeros((0, 0)), [], TreeSpec in drafter.tree_kinds
    if static:
        depth = depth or drafter.max_depth or DEFAULT_DEPTH
        calib = efficient_tree(depth, min(ranks, drafter.rankable(ranks)))
        rates = acceptance_rates(*collect_rates(gen.with_tree(calib), prompts, max_new_tokens, batch_size, progress))
        grown = [t for t, _ in grow_trees(rates, max(CANDIDATE_NODES))]
    trees = candidate_trees(drafter.tree_kinds, drafter.paper_tree, grown, lambda t: drafter.check_tree(t, vocab))
    if expect:
        expect(len(prompts) * (len(trees) + static))
    candidates = tuple(
        Candidate(name, tree, measured_tau(gen.with_tree(tree), prompts, max_new_tokens, batch_size, progress))
        for name, tree in trees)
    return Acceptance(gen.method, measured_on, candidates, tuple(tuple(r) for r in rates.round(4).tolist()))


def measure_step_seconds(gen: Generator, prompt: Sequence[int], trees: Sequence[TreeSpec], max_new_tokens: int,
                         runs: int = 3, progress: Callable[[int], None] | None = None, batch: int = 1
                         ) -> tuple[float, list[float]]:
    """(AR seconds per step, [seconds per speculative step for each tree]) of `gen`'s target and drafter on this
    device, `batch` copies of `prompt` (`StepClock`). AR is timed before and after the trees and the faster kept:
    a machine drifting during the search would otherwise price every tree against one early AR timing."""
    clock = StepClock.for_trees([gen], prompt, trees, max_new_tokens, runs, batch)
    ar = gen.autoregressive()  # one AR generator for both timings: compiled once
    first = clock.ar_step_seconds(ar)
    steps = clock.spec_step_seconds(gen, trees, progress)
    return min(first, clock.ar_step_seconds(ar)), steps


def measure_speedup(gen: Generator, prompts: Sequence[Sequence[int]], batch: int, max_new_tokens: int,
                    runs: int = 3) -> float:
    """Measured speed-up of `gen` (a drafter on its tree) over AR decoding `batch` of `prompts` (cycled) greedily
    together: the ratio of their median seconds (both write the same tokens: greedy decoding is lossless)."""
    rows = [prompts[i % len(prompts)] for i in range(batch)]
    tokens, lengths = pad_prompts(rows, pad_id=gen.pad_id, multiple=64)
    cache_size = gen.spec(max_new_tokens, SamplingConfig()).cache_size(tokens.shape[1])  # AR's cache as the tree's

    def seconds(g: Generator) -> float:
        spec = g.spec(max_new_tokens, SamplingConfig())
        g.run(tokens, lengths, spec, cache_size=cache_size)  # compile + warm-up
        return float(np.median([g.run(tokens, lengths, spec, cache_size=cache_size)[1] for _ in range(runs)]))

    return seconds(gen.autoregressive()) / seconds(gen)


def report_markdown(result: SearchResult, trees: Sequence[TreeSpec], header: str) -> str:
    rows = [header, "", "| draft nodes | depth | expected tau | step ms | step / AR step | predicted tokens/s | "
            "predicted speed-up |", "|---|---|---|---|---|---|---|",
            f"| AR | - | 1.00 | {result.ar_step_seconds * 1e3:.2f} | 1.00 | {1 / result.ar_step_seconds:.1f} | 1.00x |"]
    for i, (n, tree) in enumerate(zip(result.sizes, trees, strict=True)):
        mark = " **(picked)**" if i == result.best else ""
        rows.append(f"| {n}{mark} | {tree.depth} | {result.taus[i]:.2f} | {result.step_seconds[i] * 1e3:.2f} | "
                    f"{result.step_seconds[i] / result.ar_step_seconds:.2f} | {result.tokens_per_second[i]:.1f} | "
                    f"{result.speedups[i]:.2f}x |")
    return "\n".join(rows) + "\n"


@contextlib.contextmanager
def _speedup_figure(path: str | Path, title: str) -> Iterator[Any]:
    """Axes for a speed-up plot: the 1x line (AR), then the title, the legend and the PNG at `path`."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    yield ax
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def plot(result: SearchResult, path: str | Path, title: str) -> None:
    """tau, step cost (relative to an AR step) and predicted speed-up against tree size."""
    with _speedup_figure(path, title) as ax:
        ax.plot(result.sizes, result.taus, "o-", label="expected tau (tokens / step)")
        ax.plot(result.sizes, [s / result.ar_step_seconds for s in result.step_seconds], "s-",
                label="measured step cost / AR step")
        ax.plot(result.sizes, result.speedups, "^-", label="predicted speed-up")
        ax.axvline(result.sizes[result.best], color="green", lw=0.8, ls=":", label="picked")
        ax.set_xlabel("draft nodes in the tree (root not counted)")


def plot_batches(results: dict[int, SearchResult], measured: dict[int, float], path: str | Path, title: str) -> None:
    """Predicted (the picked tree's) and measured speed-up against batch size."""
    sizes = sorted(results)
    with _speedup_figure(path, title) as ax:
        ax.plot(sizes, [results[b].speedups[results[b].best] for b in sizes], "o-", label="predicted (picked tree)")
        ax.plot(sizes, [measured[b] for b in sizes], "s-", label="measured (picked tree, calibration prompts)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size (rows decoded together)")
        ax.set_ylabel("speed-up over AR at that batch")


def batch_markdown(results: dict[int, SearchResult], measured: dict[int, float], policy: TreePolicy) -> str:
    rows = ["| batch | picked draft nodes | predicted speed-up | measured speed-up | `--tree auto` |",
            "|---|---|---|---|---|"]
    for b, r in sorted(results.items()):
        tree = policy.at(b)
        rows.append(f"| {b} | {r.sizes[r.best]} | {r.speedups[r.best]:.2f}x | {measured[b]:.2f}x | "
                    f"{'no speculation' if tree is None else f'{tree.num_nodes - 1} nodes'} |")
    return "\n".join(rows) + "\n"


def output_paths(out_path: Path) -> tuple[Path, ...]:
    """The tree JSON and, beside it, the tree policy per batch size, the report (JSON, markdown) and the plots that
    `search` writes."""
    stem = out_path.with_suffix("")
    return (out_path, stem.with_suffix(".batch.json"), stem.with_suffix(".report.json"), stem.with_suffix(".report.md"),
            stem.with_suffix(".png"), stem.with_suffix(".batch.png"))


def searched_drafter(heads: str | Path) -> DrafterSource:
    """The drafter a search is for, read once (`read_source`): a draft-head checkpoint directory, or a method with
    nothing to train named by itself (`prompt_lookup`)."""
    from amphista_jax.drafters import VARIANTS

    name = str(heads)
    return read_source(name if name in VARIANTS and not VARIANTS[name].trainable else Path(name), None, None)


def search(model_dir: str | Path, heads_dir: str | Path, prompts: Sequence[str], out_path: Path, *, max_nodes: int = 63,
           ranks: int = 10, max_new_tokens: int = 96, runs: int = 3, sizes: Sequence[int] = DEFAULT_SIZES,
           batch_sizes: Sequence[int] = (1,), depth: int | None = None) -> tuple[dict[int, SearchResult], TreePolicy]:
    """The whole search for trained heads: statistics on `prompts`, growth, timing on this device at each of
    `batch_sizes`; writes the tree picked at the smallest batch size to `out_path` (JSON paths), the tree policy
    per batch size (`<stem>.batch.json`, decoded on with `--tree <path>`), `<stem>.report.{json,md}` and the plots
    `<stem>.png` (trees at the smallest batch size) and `<stem>.batch.png` (speed-up against batch size).
    `depth`: the deepest draft node (default: the heads' depth; `DEFAULT_DEPTH` for a drafter that drafts to any
    depth, such as EAGLE's, whose static trees are grown from the same statistics). `heads_dir` may also name a
    method with nothing to train (`prompt_lookup`); the calibration tree then ranks as many candidates per depth as
    it does (its `branches`), if fewer than `ranks`."""
    import json

    from tqdm import tqdm

    source = searched_drafter(heads_dir)
    drafter, method = source.drafter, source.method
    if TreeSpec not in drafter.tree_kinds:
        raise TreeSearchError(f"tree search grows static trees; {method} drafts dynamic trees only: use its paper's "
                              f"tree ({drafter.paper_tree})")
    depth = depth or drafter.max_depth or DEFAULT_DEPTH
    if drafter.max_depth is not None and depth > drafter.max_depth:
        raise TreeSearchError(f"--depth {depth}: the {method} heads draft {drafter.max_depth} tokens deep at most")
    batch_sizes = sorted(set(batch_sizes))
    calib = efficient_tree(depth, min(ranks, drafter.rankable(ranks)))
    probe = Generator.load(model_dir, source, calib)  # the tree checked against the drafter before weights load
    ids = [probe.encode(p) for p in prompts]
    with tqdm(total=len(ids), desc="acceptance statistics", unit="prompt") as bar:
        tries, hits = collect_rates(probe, ids, max_new_tokens, progress=bar.update)
    rates = acceptance_rates(tries, hits)
    grown = grow_trees(rates, max_nodes)
    if not grown:
        raise TreeSearchError(f"no draft of the heads in {heads_dir} was accepted on the {len(prompts)} calibration "
                              f"prompts ({int(np.sum(tries))} tries): train the heads, or calibrate on more prompts")
    measured_sizes = set(sizes) | {len(grown)}  # the grid, and the largest tree the statistics allow
    picked = [i for i in range(len(grown)) if i + 1 in measured_sizes]
    trees = [grown[i][0] for i in picked]
    results, measured = {}, {}
    with tqdm(total=len(trees) * len(batch_sizes), desc=f"timing trees on {jax.default_backend()}",
              unit="tree") as bar:
        for b in batch_sizes:
            ar_step, step_seconds = measure_step_seconds(probe, ids[0], trees, max_new_tokens, runs,
                                                         progress=bar.update, batch=b)
            results[b] = pick([i + 1 for i in picked], [grown[i][1] for i in picked], step_seconds, ar_step, b)
            measured[b] = measure_speedup(probe.with_tree(trees[results[b].best]), ids, b, max_new_tokens, runs)
    policy = tree_policy(results, trees)
    first = results[batch_sizes[0]]
    best = trees[first.best]
    machine = this_machine()
    device = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out_path, json.dumps([list(p) for p in best.choices]) + "\n")
    _, policy_json, report_json, report_md, png, batch_png = output_paths(out_path)
    write_atomic(policy_json, json.dumps(policy.to_json()) + "\n")
    title = (f"{method} heads on {device}, batch {batch_sizes[0]}: picked {first.sizes[first.best]} draft nodes, "
             f"predicted {first.speedups[first.best]:.2f}x")
    report = {"method": method, "heads": Path(heads_dir).name, "model": Path(model_dir).name, "device": device,
              "machine": dataclasses.asdict(machine),
              "calibration_prompts": len(prompts), "calibration_tree_nodes": calib.num_nodes - 1,
              "max_new_tokens": max_new_tokens, "rates": rates.round(4).tolist(),
              "node_tries": np.asarray(tries).tolist(), "node_hits": np.asarray(hits).tolist(),
              "ar_step_ms": first.ar_step_seconds * 1e3, "picked": best.choices, "policy": policy.to_json(),
              "trees": _tree_rows(first, trees),
              "batches": [{"batch": b, "ar_step_ms": r.ar_step_seconds * 1e3, "picked_nodes": r.sizes[r.best],
                           "predicted_speedup": r.speedups[r.best], "measured_speedup": measured[b],
                           "trees": _tree_rows(r, trees)} for b, r in sorted(results.items())]}
    write_atomic(report_json, json.dumps(report, indent=1) + "\n")
    header = (f"# Tree search: {title}\n\nExpected tau from greedy acceptance statistics on {len(prompts)} calibration "
              f"prompts; step times measured on this machine ({machine.describe()}; fastest of {runs}, "
              f"{max_new_tokens} new tokens). "
              "Predicted speed-up = expected tau x AR step / step: a model prediction; the measured speed-up decodes "
              "B calibration prompts with the picked tree and with AR.\n\n## Per batch size\n\n"
              f"{batch_markdown(results, measured, policy)}\n## Trees at batch {batch_sizes[0]}")
    write_atomic(report_md, report_markdown(first, trees, header))
    plot(first, png, title)
    plot_batches(results, measured, batch_png, f"{method} heads on {device}: speed-up against batch size")
    return results, policy


def _tree_rows(result: SearchResult, trees: Sequence[TreeSpec]) -> list[dict]:
    return [{"draft_nodes": n, "depth": t.depth, "expected_tau": tau, "step_ms": s * 1e3, "predicted_tokens_per_s": tps,
             "predicted_speedup": sp, "choices": t.choices}
            for n, t, tau, s, tps, sp in zip(result.sizes, trees, result.taus, result.step_seconds,
                                             result.tokens_per_second, result.speedups, strict=True)]
