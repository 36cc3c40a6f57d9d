"""A decode's token budget has one home, its `DecodeSpec`: every door that allocates a cache allocates
`spec.cache_size(prompt_length)`, and a decode's output carries each row's steps and tau."""

from __future__ import annotations

import numpy as np
import pytest

from amphista_jax import Generator
from amphista_jax.choice.step_clock import StepClock
from amphista_jax.engine import memory_plan
from amphista_jax.engine.decode import pad_prompts
from amphista_jax.engine.decode_spec import DecodeSpec, bucket, scratch_slots
from amphista_jax.trees.names import get_tree

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):"]


@pytest.fixture(scope="module")
def bita():
    """BiTA on the embedded model: its verify forward writes mask groups past the tree's nodes (extras)."""
    return Generator.load(heads="bita", tree="small-8")


def test_the_spec_counts_the_tree_and_the_drafters_extras(bita):
    spec = bita.spec(12)
    assert spec.scratch == scratch_slots(bita.drafter, bita.tree) > bita.tree.num_nodes  # extras counted
    assert spec.cache_size(32) == 32 + 12 + spec.scratch
    assert bita.autoregressive().spec(12).cache_size(32) == 32 + 12  # AR writes no scratch slots


def test_generate_and_stream_allocate_the_specs_cache(bita):
    gen = bita.with_tree("small-8")
    gen.release_programs()  # the target's one cache: empty, so the program below is this call's
    out = gen.generate(PROMPTS, max_new_tokens=12)
    [(shape, spec, cache_size, _)] = list(gen.target.programs)
    assert shape[1] == bucket(max(len(gen.encode(p)) for p in PROMPTS))
    assert cache_size == spec.cache_size(shape[1])
    tokens, lengths = pad_prompts([gen.encode(PROMPTS[0])], length=bucket(len(gen.encode(PROMPTS[0]))))
    _, state = gen.start(tokens, lengths, spec)
    assert state.cache.size == spec.cache_size(tokens.shape[1])
    assert "".join(gen.stream(PROMPTS[0], max_new_tokens=12)) == gen.generate(PROMPTS[0], max_new_tokens=12).texts[0]
    # the output carries each row's steps and tau: no caller derives them
    rows = out.output
    assert (np.asarray(rows.accept_lengths).sum(1) == np.asarray(rows.num_tokens) - 1).all()
    assert (rows.row_steps <= int(rows.steps)).all() and rows.row_steps.max() == int(rows.steps)
    assert out.tau == [float(t) for t in (np.asarray(rows.num_tokens) - 1) / rows.row_steps]


def test_the_memory_plan_and_the_step_clock_allocate_the_specs_cache(bita, monkeypatch):
    tree = get_tree("small-8")
    seen = {}

    class Stop(Exception):
        pass

    class Recorder:
        @staticmethod
        def lower(*args, spec: DecodeSpec, cache_size: int):
            seen.update(spec=spec, cache_size=cache_size)
            raise Stop

    monkeypatch.setattr(memory_plan, "decode", Recorder)
    with pytest.raises(Stop):
        memory_plan.decode_plan(bita.config, bita.drafter, tree, None, np.float32, 2, 48, 20)
    assert seen["cache_size"] == seen["spec"].cache_size(48) == 48 + 20 + scratch_slots(bita.drafter, tree)

    trees = [get_tree("chain-2"), tree]
    clock = StepClock.for_trees([bita], bita.encode(PROMPTS[0]), trees, 10, 1)
    t = clock.tokens.shape[1]
    assert clock.cache_size == max(bita.with_tree(x).spec(10).cache_size(t) for x in trees)
