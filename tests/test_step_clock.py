"""StepClock's noise handling: a decode timed no longer than its prefill is timed again, then refused."""

from __future__ import annotations

import numpy as np
import pytest

from amphista_jax.step_clock import NOISE_RETRIES, StepClock, TimingError


class ScriptedRuns:
    """`StepClock.timed_runs` with scripted seconds: the one-token decodes (prefills) from `prefills`, the whole
    decodes from `decodes`, one run each, `steps` steps a whole decode."""

    def __init__(self, prefills: list[float], decodes: list[float], steps: int = 10):
        self.prefills, self.decodes, self.steps = list(prefills), list(decodes), steps

    def __call__(self, gen: object, new_tokens: int) -> tuple[list[float], int]:
        if new_tokens == 1:
            return [self.prefills.pop(0)], 1
        return [self.decodes.pop(0)], self.steps


def clock() -> StepClock:
    return StepClock(np.zeros((1, 4), np.int32), np.array([4]), 32, 11, 1)


def test_an_inflated_prefill_is_timed_again_and_the_fastest_kept(monkeypatch):
    # the first prefill was hit by noise (60 ms); timed again it takes 50 ms; the decodes take 70 and 71 ms
    runs = ScriptedRuns(prefills=[0.060, 0.050], decodes=[0.058, 0.070])
    monkeypatch.setattr(StepClock, "timed_runs", lambda _, gen, new_tokens: runs(gen, new_tokens))
    timing = clock().ar_timing(object())
    assert timing.prefill_s == pytest.approx(0.050)
    assert timing.step_s == pytest.approx((0.058 - 0.050) / 10)  # the fastest decode, less the fastest prefill
    assert timing.spread == pytest.approx((0.070 - 0.058) / 0.058)
    assert not runs.prefills and not runs.decodes


def test_noise_that_persists_is_refused_in_one_line(monkeypatch):
    runs = ScriptedRuns(prefills=[0.060] * (NOISE_RETRIES + 1), decodes=[0.059] * (NOISE_RETRIES + 1))
    monkeypatch.setattr(StepClock, "timed_runs", lambda _, gen, new_tokens: runs(gen, new_tokens))
    with pytest.raises(TimingError, match="took no longer than its prefill"):
        clock().ar_timing(object())
    assert not runs.prefills and not runs.decodes  # every retry was taken


def test_a_fixed_prefill_is_refused_at_once(monkeypatch):
    """Without the prefill's program, timing the decode again could only make it faster: no retry."""
    runs = ScriptedRuns(prefills=[], decodes=[0.040])
    monkeypatch.setattr(StepClock, "timed_runs", lambda _, gen, new_tokens: runs(gen, new_tokens))
    with pytest.raises(TimingError, match="took no longer than its prefill"):
        clock().step_timing(object(), 0.050)
    assert not runs.decodes
