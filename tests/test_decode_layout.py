"""Decode-time layouts: inside the compiled decode loop no weight and no KV cache is copied on every step (under
XLA:CPU a slice of a stacked array is a copy).

* The target (`split_layers`, what decoding loads): the AR loop reads every layer's weights in place, while the
  scanned stack slices (copies) each layer's weights on every step.
* The head methods (`decode_params`): no instruction reads the stacked per-head vocabulary projections
  `[K, D, V]`; they are split into one array per head once, before the loop."""

from __future__ import annotations

import re

import jax
import pytest

from amphista_jax.drafters import VARIANTS
from amphista_jax.engine.decode import decode, pad_prompts
from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.models.llama import init_params
from amphista_jax.models.param_layout import split_layers
from amphista_jax.models.target import Target
from amphista_jax.trees.tree import chain
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


# An instruction's result type and opcode: `%name = f32[64,128]{1,0} fusion(...)`.
_INSTRUCTION = re.compile(r"= (\w+\[[\d,]*\])\S* ([\w-]+)\(")
# Opcodes that name an existing buffer (a loop-carried or called computation's input) rather than write one.
_IN_PLACE = {"parameter", "get-tuple-element", "bitcast"}


def layer_weight_writes(params: dict, split: bool) -> list[tuple[str, str]]:
    """(computation, opcode) of every instruction inside the compiled AR loop of `generate` that writes an array
    of one layer's weight-matrix shape (a per-step copy of that weight)."""
    shapes = {f"f32[{','.join(map(str, w.shape[1:]))}]" for w in jax.tree.leaves(params["layers"]) if w.ndim == 3}
    shapes |= {f"f32[1,{s[4:]}" for s in shapes}  # a dynamic slice keeps the layer axis
    tokens, lengths = pad_prompts(PROMPTS)
    hlo = decode.lower(split_layers(params) if split else params, None, tokens, lengths, jax.random.key(0),
                       spec=DecodeSpec(CONFIG, None, None, 8), cache_size=tokens.shape[1] + 8).compile().as_text()
    comps = computations(hlo)
    in_loop = loop_computations(hlo)
    assert in_loop, "no while loop found in the compiled program"
    return [(name, m[2]) for name in in_loop for m in _INSTRUCTION.finditer(comps[name])
            if m[1] in shapes and m[2] not in _IN_PLACE]


def test_decoding_layout_reads_layer_weights_in_place():
    """The AR loop over `split_layers` params writes no array of a layer weight's shape; the same check finds
    the per-step slices of the scanned stack (so it can fail)."""
    params = init_params(CONFIG, jax.random.key(0))
    assert layer_weight_writes(params, split=True) == []
    assert {op for _, op in layer_weight_writes(params, split=False)} & {"dynamic-slice", "fusion", "copy"}


def cache_writes(split: bool) -> list[str]:
    """The instructions of the compiled AR loop of `generate` (outside fusion bodies) that write a new array of
    the KV cache's shape or of one layer's slice of it: a copy of the cache on every step. Scatters into the
    cache (fused or not) update it in place and are left out."""
    params = init_params(CONFIG, jax.random.key(0))
    tokens, lengths = pad_prompts(PROMPTS)
    size = tokens.shape[1] + 8
    hlo = decode.lower(split_layers(params) if split else params, None, tokens, lengths, jax.random.key(0),
                       spec=DecodeSpec(CONFIG, None, None, 8), cache_size=size).compile().as_text()
    layer = f"{len(PROMPTS)},{size},{CONFIG.num_kv_heads},{CONFIG.head_dim}]"
    shapes = {f"f32[{CONFIG.num_layers},{layer}", f"f32[{layer}", f"f32[1,{layer}"}
    comps = computations(hlo)
    return [line.strip()[:160] for name in loop_computations(hlo) if not name.startswith(("fused_", "wrapped_"))
            for line in comps[name].splitlines() if (m := _INSTRUCTION.search(line)) and m[1] in shapes
            and m[2] not in _IN_PLACE | {"scatter"} and "calls=%wrapped_scatter" not in line]


def test_decode_loop_updates_the_kv_cache_in_place():
    """Over `split_layers` params each layer writes its keys/values into the whole cache in place and reads its
    slice there: no per-layer copy and no restack of the cache on every step (at batch 64 these were ~3/4 of the
    step's memory traffic). The scanned stack's per-step cache copies show the check can fail."""
    assert cache_writes(split=True) == []
    assert cache_writes(split=False)


@pytest.mark.parametrize("method", ["medusa", pytest.param("amphista", marks=pytest.mark.slow), "hydra"])
def test_stacked_head_projections_are_not_read_inside_the_decode_loop(method):
    params = init_params(CONFIG, jax.random.key(0))
    drafter = VARIANTS[method]
    draft = drafter.init(jax.random.key(1), Target(CONFIG, params))
    stacked = draft["lm_head"]
    shape = f"f32[{','.join(map(str, stacked.shape))}]"  # [K, D, V]
    tokens, lengths = pad_prompts(PROMPTS)
    hlo = decode.lower(
        params, draft, tokens, lengths, jax.random.key(0), spec=DecodeSpec(CONFIG, drafter, chain(2), 8),
        cache_size=tokens.shape[1] + 8 + 3).compile().as_text()
    comps = computations(hlo)
    in_loop = loop_computations(hlo)
    assert in_loop, "no while loop found in the compiled program"
    assert shape in hlo  # the parameter itself, split before the loop
    assert [name for name in in_loop if shape in comps[name]] == []
