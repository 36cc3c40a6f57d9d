"""The head methods' decode-time layout (`decode_params`): inside the compiled decode loop no instruction reads
the stacked per-head vocabulary projections `[K, D, V]`; they are split into one array per head once, before
the loop (under XLA:CPU a head's slice of the stacked weights is a copy made on every step)."""

from __future__ import annotations

import re

import jax
import pytest

from amphista_jax.decode import pad_prompts, speculative_generate
from amphista_jax.drafters import VARIANTS, Target
from amphista_jax.models.llama import init_params
from amphista_jax.trees import chain
from tests.helpers import CONFIG, PROMPTS

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ", re.M)
_CALLS = re.compile(r"(?:calls|body|condition|to_apply|branch_computations)=\{?(%[\w.\-]+(?:, %[\w.\-]+)*)\}?")


def computations(hlo: str) -> dict[str, str]:
    """Name -> text of each computation of an HLO module's text."""
    starts = [(m.group(1), m.start()) for m in _COMPUTATION.finditer(hlo)]
    return {name: hlo[a:b] for (name, a), (_, b) in zip(starts, starts[1:] + [("", len(hlo))], strict=True)}


def loop_computations(hlo: str) -> set[str]:
    """The computations a `while` runs (its body and condition) and everything they call, transitively."""
    comps = computations(hlo)
    todo = [name.lstrip("%") for text in comps.values() for m in re.finditer(r"(?:body|condition)=(%[\w.\-]+)", text)
            for name in [m.group(1)]]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += [c.lstrip("%") for m in _CALLS.finditer(comps[name]) for c in m.group(1).split(", ")]
    return seen


@pytest.mark.parametrize("method", ["medusa", pytest.param("amphista", marks=pytest.mark.slow), "hydra"])
def test_stacked_head_projections_are_not_read_inside_the_decode_loop(method):
    params = init_params(CONFIG, jax.random.key(0))
    drafter = VARIANTS[method]
    draft = drafter.init(jax.random.key(1), Target(CONFIG, params))
    stacked = draft["lm_head"]
    shape = f"f32[{','.join(map(str, stacked.shape))}]"  # [K, D, V]
    tokens, lengths = pad_prompts(PROMPTS)
    hlo = speculative_generate.lower(
        params, draft, tokens, lengths, jax.random.key(0), config=CONFIG, drafter=drafter, tree=chain(2),
        max_new_tokens=8, cache_size=tokens.shape[1] + 8 + 3).compile().as_text()
    comps = computations(hlo)
    in_loop = loop_computations(hlo)
    assert in_loop, "no while loop found in the compiled program"
    assert shape in hlo  # the parameter itself, split before the loop
    assert [name for name in in_loop if shape in comps[name]] == []
