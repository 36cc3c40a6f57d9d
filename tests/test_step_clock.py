"""StepClock's noise handling: a prefill no shorter than a whole decode is timed again, then refused; every tree is
priced on the one fastest prefill."""

from __future__ import annotations

import numpy as np
import pytest

from amphista_jax.choice import step_clock
from amphista_jax.choice.step_clock import NOISE_RETRIES, StepClock, TimingError


class ScriptedRuns:
    """`StepClock.timed_runs` with scripted seconds, one run a timing: the one-token decodes (prefills) from
    `prefills`, the whole decodes from `decodes`, each of `steps` steps."""

    def __init__(self, prefills: list[float], decodes: list[float], steps: int = 10):
        self.prefills, self.decodes, self.steps = list(prefills), list(decodes), steps

    def __call__(self, gen: object, new_tokens: int) -> tuple[list[float], int]:
        if new_tokens == 1:
            return [self.prefills.pop(0)], 1
        return [self.decodes.pop(0)], self.steps


class OneProgram:
    """A generator stand-in: every tree is itself (the scripted runs ignore it)."""

    def with_tree(self, tree: object) -> OneProgram:
        return self


@pytest.fixture
def script(monkeypatch):
    def install(prefills: list[float], decodes: list[float]) -> ScriptedRuns:
        runs = ScriptedRuns(prefills, decodes)
        monkeypatch.setattr(StepClock, "timed_runs", lambda _, gen, new_tokens: runs(gen, new_tokens))
        monkeypatch.setattr(step_clock, "release_if_crowded", lambda: False)
        return runs
    return install


def clock() -> StepClock:
    return StepClock(np.zeros((1, 4), np.int32), np.array([4]), 32, 11, 1)


def test_an_inflated_prefill_is_timed_again_and_the_fastest_kept(script):
    # the decode takes 58 ms; the first prefill, hit by noise, 60 ms; timed again, 50 ms
    runs = script(prefills=[0.060, 0.050], decodes=[0.058])
    timing = clock().step_timing(OneProgram())
    assert timing.prefill_s == pytest.approx(0.050)
    assert timing.step_s == pytest.approx((0.058 - 0.050) / 10)
    assert not runs.prefills and not runs.decodes


def test_noise_that_persists_is_refused_in_one_line(script):
    runs = script(prefills=[0.060] * (1 + NOISE_RETRIES), decodes=[0.059])
    with pytest.raises(TimingError, match="took no longer than its prefill"):
        clock().step_timing(OneProgram())
    assert not runs.prefills  # every retry was taken


def test_a_given_prefill_is_not_timed_again(script):
    runs = script(prefills=[0.045], decodes=[0.040])
    with pytest.raises(TimingError, match="took no longer than its prefill"):
        clock().step_timing(OneProgram(), 0.050)
    assert runs.prefills == [0.045]


def test_every_tree_is_priced_on_the_fastest_prefill(script):
    """The prefill timed again for the second tree's decode prices the first tree too."""
    runs = script(prefills=[0.060, 0.050], decodes=[0.080, 0.058])
    steps = clock().spec_step_seconds(OneProgram(), ["a", "b"])
    assert steps == [pytest.approx((0.080 - 0.050) / 10), pytest.approx((0.058 - 0.050) / 10)]
    assert not runs.prefills and not runs.decodes
