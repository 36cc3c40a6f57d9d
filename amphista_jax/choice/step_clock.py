"""What a decode step costs on this machine, two ways.

- `StepClock` times whole decode loops, (decode time - prefill) / steps: tree search's pricing and the step-time
  benchmark.
- `PairClock` times a fixed number of decode steps from a started state (no prefill, no compile, no subtraction),
  and `time_pairs` times two programs in interleaved pairs (A, B, A, B, ...) as ratios B / A: a machine whose speed
  drifts, or that another process slows for a while, slows both of a pair alike, so the ratios' spread (`Pairs`)
  stays small where the spread of one program's runs timed one after another does not. `auto`'s calibration.

What is timed is a `Decoder`: a loaded target with a drafter on a tree, as this module needs it (the facade's
`Generator` is one); declared here, so that timing depends on the operations it calls, not on the facade above it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from amphista_jax.drafters.base import Drafter
from amphista_jax.engine.decode import ARState, GenerateOutput, SpecState, on_tree, pad_prompts
from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.infra.compiled_programs import release_if_crowded
from amphista_jax.infra.errors import UserError
from amphista_jax.infra.machine import cores
from amphista_jax.models.config import ModelConfig
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.tree import Tree, TreeError
from amphista_jax.trees.verify import AcceptanceConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Decoder(Protocol):
    """A loaded target, optionally with a drafter on a tree, that decodes compiled programs (`Generator`)."""

    config: ModelConfig
    drafter: Drafter | None
    tokenizer: PreTrainedTokenizerBase | None
    model_dir: str
    method: str
    attention: str
    mesh: Mesh | None

    @property
    def pad_id(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    def encode(self, prompt: str, chat: bool = False) -> list[int]: ...

    def spec(self, max_new_tokens: int, sampling: SamplingConfig = ..., acceptance: AcceptanceConfig | None = None,
             stop_at_eos: bool = True, adapt: bool = True) -> DecodeSpec: ...

    def run(self, tokens: np.ndarray, lengths: np.ndarray, spec: DecodeSpec, rng: jax.Array | int = 0,
            cache_size: int | None = None) -> tuple[GenerateOutput, float, float]: ...

    def start(self, tokens: np.ndarray, lengths: np.ndarray, spec: DecodeSpec, rng: jax.Array | int = 0,
              cache_size: int | None = None) -> tuple[Any, ARState | SpecState]: ...

    def advance(self, draft_params: Any, state: ARState | SpecState, spec: DecodeSpec, steps: int
                ) -> ARState | SpecState: ...

    def with_tree(self, tree: Tree) -> Decoder: ...

    def autoregressive(self) -> Decoder: ...


class TimingError(UserError, ValueError):
    """A timing that noise made meaningless (a decode no longer than its prefill)."""


NOISE_RETRIES = 3  # times a prefill no shorter than a whole decode is timed again before it is refused as noise


class StepTiming(NamedTuple):
    step_s: float  # seconds per decode step
    spread: float  # (slowest - fastest) / fastest of the timed runs
    prefill_s: float  # the prefill subtracted: the fastest timed


@dataclasses.dataclass(frozen=True)
class Rows:
    """What a clock decodes: `batch` copies of one prompt, every program in one cache size (so only the step differs
    between them), no EOS stop."""

    tokens: np.ndarray  # [B, T]
    lengths: np.ndarray  # [B]
    cache_size: int
    max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class StepClock(Rows):
    """Times whole decode loops on its `Rows`, every run decoding `max_new_tokens` tokens; each time the fastest of
    `runs` after a compile and warm-up run (noise on a shared machine only adds time)."""

    runs: int

    @classmethod
    def for_trees(cls, gens: Sequence[Decoder], prompt: Sequence[int], trees: Sequence[Tree],
                  max_new_tokens: int, runs: int, batch: int = 1, reserve: int = 0) -> StepClock:
        """A clock of `batch` copies of `prompt` whose cache holds the scratch slots of any of `trees` under any of
        `gens`' drafters that can draft it, and at least `reserve` slots beyond the prompt and the new tokens."""
        return cls(*_rows(gens, prompt, trees, max_new_tokens, batch, reserve), runs)

    def timed_runs(self, gen: Decoder, new_tokens: int) -> tuple[list[float], int]:
        """(seconds of each of `runs` timed runs, decode steps) of `gen` writing `new_tokens` tokens, after a compile
        and warm-up run."""
        spec = gen.spec(new_tokens, SamplingConfig(), stop_at_eos=False)
        gen.run(self.tokens, self.lengths, spec, cache_size=self.cache_size)  # compile + warm-up
        results = [gen.run(self.tokens, self.lengths, spec, cache_size=self.cache_size) for _ in range(self.runs)]
        return [r[1] for r in results], int(results[-1][0].steps)

    def decode(self, gen: Decoder, new_tokens: int) -> tuple[float, int]:
        """(fastest seconds, decode steps) of `gen` writing `new_tokens` tokens."""
        seconds, steps = self.timed_runs(gen, new_tokens)
        return min(seconds), steps

    def step_timing(self, gen: Decoder, prefill_s: float | None = None) -> StepTiming:
        """`gen`'s seconds per decode step, (decode time - prefill) / steps, and the spread of its timed runs.
        `prefill_s`: the prefill to subtract; None: `gen`'s own, a one-token decode (`fastest_prefill`)."""
        runs, steps = self.timed_runs(gen, self.max_new_tokens)
        if prefill_s is None:
            prefill_s = self.fastest_prefill(gen, min(runs))
        return StepTiming(_per_step(min(runs), steps, prefill_s), (max(runs) - min(runs)) / min(runs), prefill_s)

    def fastest_prefill(self, gen: Decoder, decode_s: float, prefill_s: float = math.inf) -> float:
        """The fastest one-token decode of `gen` (its prefill; `prefill_s`: one timed before), timed while it is no
        shorter than a whole decode of `decode_s` seconds, at most `1 + NOISE_RETRIES` times: a prefill that long was
        inflated by noise (noise only adds time, and a decode is the prefill and its steps)."""
        for _ in range(1 + NOISE_RETRIES):
            if prefill_s < decode_s:
                break
            prefill_s = min(prefill_s, self.decode(gen, 1)[0])
        return prefill_s

    def ar_step_seconds(self, ar: Decoder) -> float:
        """Seconds per step of `ar`, an autoregressive generator (`Generator.autoregressive()`; the caller keeps it,
        so a second timing reuses its compiled programs), on its own prefill."""
        return self.step_timing(ar).step_s

    def spec_step_seconds(self, gen: Decoder, trees: Sequence[Tree],
                          progress: Callable[[int], None] | None = None) -> list[float]:
        """Seconds per speculative step of `gen`'s drafter on each of `trees`. The prefill (with the drafter's own,
        the same for every tree) is timed by the same programs with one new token (`fastest_prefill`, against every
        tree's decode), and every tree is priced on the fastest."""
        first = gen.with_tree(trees[0])
        decodes, prefill = [], math.inf
        for tree in trees:
            decodes.append(self.decode(gen.with_tree(tree), self.max_new_tokens))
            prefill = self.fastest_prefill(first, decodes[-1][0], prefill)
            release_if_crowded()  # a program per tree and batch size: past the memory-mapping limit otherwise
            if progress:
                progress(1)
        return [_per_step(seconds, steps, prefill) for seconds, steps in decodes]


class Started(NamedTuple):
    """A program of `PairClock`'s, compiled and warmed up: its decoder, spec, drafter params (decode layout) and the
    state after the prefill that every timing starts from."""

    gen: Decoder
    spec: DecodeSpec
    draft_params: Any
    state: ARState | SpecState


@dataclasses.dataclass(frozen=True)
class PairClock(Rows):
    """Times `steps` decode steps on its `Rows` from the state after their prefill, with new tokens enough that no
    row finishes within `steps` steps of any tree (checked), so a timing is those steps and nothing else."""

    steps: int

    @classmethod
    def for_trees(cls, gens: Sequence[Decoder], prompt: Sequence[int], trees: Sequence[Tree], steps: int,
                  batch: int = 1, reserve: int = 0) -> PairClock:
        """A clock as `StepClock.for_trees`'s, whose new tokens hold `steps` steps of the deepest of `trees` (a step
        commits at most its depth + 1 tokens) after the prefill's one."""
        max_new_tokens = 1 + steps * (1 + max((t.depth for t in trees), default=0))
        return cls(*_rows(gens, prompt, trees, max_new_tokens, batch, reserve), steps)

    def started(self, gen: Decoder, like: Started | None = None) -> Started:
        """`gen`'s programs compiled and run once to warm up, and its started state kept for the timings. `like`: a
        started program of the same drafter on another tree, whose prefill `gen`'s tree starts from (`on_tree`: no
        prefill of its own to compile)."""
        spec = gen.spec(self.max_new_tokens, SamplingConfig(), stop_at_eos=False)
        if like is not None and gen.drafter is not None and like.gen.drafter == gen.drafter:
            draft_params, state = like.draft_params, on_tree(like.state, spec, self.tokens.shape[1])
        else:
            draft_params, state = gen.start(self.tokens, self.lengths, spec, cache_size=self.cache_size)
        warm = gen.advance(draft_params, _copy(state), spec, self.steps)
        if int(warm.steps) - int(state.steps) != self.steps:
            raise TimingError(f"a timing of {self.steps} steps ran {int(warm.steps) - int(state.steps)}: rows "
                              f"finished within {self.max_new_tokens} new tokens")
        return Started(gen, spec, draft_params, state)

    def start_all(self, gens: Sequence[Decoder], like: Started | None = None) -> list[Started]:
        """`started` for each of `gens`, compiled concurrently on this machine's cores (XLA's compiler runs one
        program on one core), each after `like` where given."""
        with ThreadPoolExecutor(min(len(gens), cores()) or 1) as pool:
            return list(pool.map(lambda g: self.started(g, like), gens))

    def time(self, begun: Started) -> float:
        """Seconds of `steps` decode steps from a copy of `begun`'s state (the copy made before the clock starts)."""
        state = jax.block_until_ready(_copy(begun.state))
        t0 = time.perf_counter()
        jax.block_until_ready(begun.gen.advance(begun.draft_params, state, begun.spec, self.steps))
        return time.perf_counter() - t0


@dataclasses.dataclass(frozen=True)
class Pairs:
    """Interleaved timings of two programs, A and B (`time_pairs`): B's cost in A's is the median ratio, and the
    noise of that estimate is the ratios' interquartile range relative to it."""

    a_s: tuple[float, ...]
    b_s: tuple[float, ...]

    @property
    def count(self) -> int:
        return len(self.a_s)

    @property
    def ratios(self) -> np.ndarray:
        return np.asarray(self.b_s) / np.asarray(self.a_s)

    @property
    def ratio(self) -> float:
        """B's seconds over A's, the median of the pairs'."""
        return float(np.median(self.ratios))

    @property
    def spread(self) -> float:
        """(75th - 25th percentile) / median of the pairs' ratios (0 for one pair)."""
        q25, q75 = np.percentile(self.ratios, [25, 75])
        return float((q75 - q25) / self.ratio)


def time_pairs(time_a: Callable[[], float], time_b: Callable[[], float], enough: Callable[[Pairs], bool],
               max_pairs: int) -> Pairs:
    """A, B, A, B, ...: pairs of timings (`time_a()`, `time_b()`, seconds) until `enough(pairs)` or `max_pairs`."""
    pairs = Pairs((), ())
    while pairs.count < max_pairs and not (pairs.count and enough(pairs)):
        a = time_a()
        pairs = Pairs((*pairs.a_s, a), (*pairs.b_s, time_b()))
    return pairs


def _copy(state: ARState | SpecState) -> ARState | SpecState:
    """A state in fresh buffers (the timed step donates its input)."""
    return jax.tree.map(jnp.copy, state)


def _rows(gens: Sequence[Decoder], prompt: Sequence[int], trees: Sequence[Tree], max_new_tokens: int, batch: int,
          reserve: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """`Rows`' fields: `batch` copies of `prompt` right-padded to a multiple of 64 (`[B, T]`, lengths `[B]`), one cache
    size for AR and every tree of `trees` under any of `gens`' drafters that can draft it (with at least `reserve`
    slots beyond the prompt and the new tokens), and `max_new_tokens`."""
    tokens, lengths = pad_prompts([prompt] * batch, pad_id=gens[0].pad_id, multiple=64)
    sizes = [DecodeSpec(gens[0].config, None, None, max_new_tokens).cache_size(tokens.shape[1]) + reserve]
    for g, t in ((g, t) for g in gens if g.drafter is not None for t in trees):
        try:
            sizes.append(DecodeSpec(g.config, g.drafter, t, max_new_tokens).cache_size(tokens.shape[1]))
        except TreeError:  # a tree its drafter cannot draft is never timed on this clock
            continue
    return tokens, lengths, max(sizes), max_new_tokens


def _per_step(seconds: float, steps: int, prefill_s: float) -> float:
    """(a whole decode's `seconds` - `prefill_s`) / `steps`, refused where noise made the decode no longer than its
    prefill."""
    if steps < 1 or seconds <= prefill_s:
        raise TimingError(f"timing noise: a whole decode ({seconds * 1e3:.2f} ms, {steps} steps) took no longer "
                          f"than its prefill ({prefill_s * 1e3:.2f} ms): time more tokens, or on a quieter machine")
    return (seconds - prefill_s) / steps
