"""`auto`'s calibration times AR and a candidate in interleaved pairs, as ratios: on synthetic timings, a machine
whose speed drifts gives a small ratio spread where timing one program after the other gives a large one, and a
burst on one pair does not move the estimate; pairs stop once the estimate is settled. On the embedded model,
`PairClock` times a fixed number of steps from a started state, and a tree started from another's prefill
(`decode.on_tree`) decodes the same tokens as one started on its own."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.choice.calibration import MAX_PAIRS, MIN_PAIRS, settled
from amphista_jax.choice.step_clock import PairClock, Pairs, TimingError, time_pairs
from amphista_jax.engine.decode import on_tree
from amphista_jax.infra.errors import DecodeSpecError
from amphista_jax.trees.tree import TreeSpec, chain


class DriftingMachine:
    """Seconds of a program of `cost` on a machine that slows by `drift` (relative) with every timing taken, with
    `burst` (a factor) on the timings numbered in `hit`."""

    def __init__(self, drift: float, burst: float = 1.0, hit: frozenset[int] = frozenset()):
        self.drift, self.burst, self.hit, self.calls = drift, burst, hit, 0

    def timer(self, cost: float):
        def time() -> float:
            factor = (1 + self.drift) ** self.calls * (self.burst if self.calls in self.hit else 1.0)
            self.calls += 1
            return cost * factor
        return time


def sequential_spread(machine: DriftingMachine, runs: int) -> tuple[float, float]:
    """The old way, on `machine`: AR's runs, then the candidate's (cost 1.25 AR), each program's fastest kept: (the
    ratio it gives, the larger relative spread of one program's runs)."""
    ar = [machine.timer(1.0)() for _ in range(runs)]
    candidate = [machine.timer(1.25)() for _ in range(runs)]
    return min(candidate) / min(ar), max((max(t) - min(t)) / min(t) for t in (ar, candidate))


def test_pairs_cancel_a_drifting_machine_that_sequential_timing_does_not():
    """A machine 2% slower at every timing: sequential timing is 13% off, its runs 10% apart; the pairs' ratio is
    within 2% of the true 1.25 and their spread 0."""
    seq_ratio, seq_spread = sequential_spread(DriftingMachine(0.02), 6)
    machine = DriftingMachine(0.02)
    pairs = time_pairs(machine.timer(1.0), machine.timer(1.25), lambda p: False, 6)
    assert pairs.count == 6 and machine.calls == 12
    assert pairs.ratio == pytest.approx(1.25 * 1.02, rel=1e-9)  # each pair's B one timing after its A
    assert pairs.spread == pytest.approx(0.0, abs=1e-9)
    assert abs(seq_ratio / 1.25 - 1) > 0.1 and seq_spread > 0.1


def test_a_burst_on_one_timing_leaves_the_median_ratio_and_a_small_spread():
    """Another process doubles one timing of six pairs: the median ratio and the interquartile spread hold."""
    machine = DriftingMachine(0.0, burst=2.0, hit=frozenset({5}))  # the third pair's candidate timing
    pairs = time_pairs(machine.timer(1.0), machine.timer(1.25), lambda p: False, 6)
    assert pairs.ratios[2] == pytest.approx(2.5) and pairs.ratio == pytest.approx(1.25)
    assert pairs.spread == pytest.approx(0.0)
    quiet = Pairs((1.0, 1.0, 1.0, 1.0), (1.20, 1.25, 1.30, 1.25))
    assert quiet.spread == pytest.approx((1.2625 - 1.2375) / 1.25)


@pytest.mark.parametrize(("ratios", "tau", "pairs"), [
    ([1.0, 1.0, 1.0], 1.5, MIN_PAIRS),  # quiet: settled at the least
    ([2.0, 2.3, 1.8], 1.5, MIN_PAIRS),  # noisy but a clear loss (at most 0.83x)
    ([1.0, 1.25, 0.8], 2.0, MIN_PAIRS),  # noisy but a clear win (2.0x above 1 + its ~22% spread)
    ([1.0, 1.2, 0.9], 1.05, MAX_PAIRS),  # near 1x inside its noise: every pair is timed
])
def test_pairs_stop_once_the_estimate_is_settled(ratios, tau, pairs):
    ar = iter(itertools.repeat(1.0))
    candidate = iter(itertools.cycle(ratios))
    measured = time_pairs(lambda: next(ar), lambda: next(candidate), lambda p: settled(p, tau), MAX_PAIRS)
    assert measured.count == pairs


@pytest.fixture(scope="module")
def medusa():
    from amphista_jax import Generator

    return Generator.load(heads="medusa", tree="chain-1")


def test_a_tree_started_from_anothers_prefill_decodes_as_its_own_start(medusa):
    """`PairClock.started(like=)` reuses the first tree's prefill; `steps` steps from it give the tokens and node
    statistics of the same tree started on its own, and the clock times exactly those steps."""
    trees = [chain(1), TreeSpec(((0,), (1,), (0, 0)))]
    clock = PairClock.for_trees([medusa], medusa.encode("def add(a, b):"), trees, steps=4)
    assert clock.max_new_tokens == 1 + 4 * 3  # a 2-deep tree's steps commit at most 3 tokens
    first = clock.started(medusa.with_tree(trees[0]))
    borrowed, own = clock.started(medusa.with_tree(trees[1]), like=first), clock.started(medusa.with_tree(trees[1]))
    assert borrowed.state.node_tries.shape == own.state.node_tries.shape != first.state.node_tries.shape
    ends = [s.gen.advance(s.draft_params, jax.tree.map(jnp.copy, s.state), s.spec, clock.steps)
            for s in (borrowed, own)]
    for field in ("tokens", "num_tokens", "node_tries", "node_hits", "steps"):
        np.testing.assert_array_equal(getattr(ends[0], field), getattr(ends[1], field))
    assert int(ends[0].steps) == 4 and clock.time(borrowed) > 0
    assert int(borrowed.state.steps) == 0  # timing ran on a copy: the started state is kept
    with pytest.raises(DecodeSpecError, match="straight after its prefill"):
        on_tree(ends[0], own.spec, clock.tokens.shape[1])


def test_a_clock_too_short_for_its_steps_is_refused(medusa):
    clock = PairClock.for_trees([medusa], medusa.encode("def add(a, b):"), [chain(1)], steps=4)
    short = PairClock(clock.tokens, clock.lengths, clock.cache_size, 3, 4)  # 3 new tokens cannot hold 4 steps
    with pytest.raises(TimingError, match="ran 2"):
        short.started(medusa.autoregressive())
