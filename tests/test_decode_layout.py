"""Decode-time layouts: inside the compiled decode loop no weight and no KV cache is copied on every step (under
XLA:CPU a slice of a stacked array is a copy).

* The target (`split_layers`, what decoding loads): the AR loop reads every layer's weights in place, while the
  scanned stack slices (copies) each layer's weights on every step.
* The head methods (`decode_params`): no instruction reads the stacked per-head vocabulary projections
  `[K, D, V]`; they are split into one array per head once, before the loop."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
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


@pytest.mark.parametrize("rows", [1, 5, 40])  # one row, a few (the fused form), more than FEW_ROWS (a plain product)
def test_an_int8_projection_is_its_dequantized_weights_product(rows):
    """`int8_rows` rounds each weight to within half its row's step, and `rows_product` over the int8 weight and its
    scales equals the product with the dequantized weight (to 1e-3 of its largest output where the CPU kernel rounds
    the activations to int16 steps: its bound is `test_int8_rows_kernel.py`'s); `int8_projections` quantizes each
    projection once."""
    import numpy as np

    from amphista_jax.models.projections import int8_projections, int8_rows, rows_product

    weight = jax.random.normal(jax.random.key(0), (48, 24)).at[3].set(0.0)  # a zero row keeps a zero scale
    q = int8_rows(weight)
    dequantized = np.asarray(q["weight"], np.float32) * np.asarray(q["weight_scale"])[:, None]
    assert np.all(np.abs(dequantized - np.asarray(weight)) <= np.asarray(q["weight_scale"])[:, None] / 2 + 1e-7)
    x = jax.random.normal(jax.random.key(1), (1, rows, 24))
    expected = np.asarray(x) @ dequantized.T
    np.testing.assert_allclose(np.asarray(rows_product(q["weight"], x, q["weight_scale"])), expected, rtol=1e-5,
                               atol=1e-3 * np.max(np.abs(expected)))
    tree = {"proj": {"weight": weight, "bias": jnp.ones(48)}, "embed": {"embedding": weight}}
    once = int8_projections(tree)
    assert once["proj"]["weight"].dtype == jnp.int8 and once["embed"]["embedding"].dtype == jnp.float32
    assert jax.tree.map(lambda a, b: a is b, int8_projections(once), once) == jax.tree.map(lambda a: True, once)


def test_int8_draft_weights_are_read_where_they_lie():
    """A draft model drafting from int8 projections (`weights="int8"`): the decode loop reads every projection's int8
    weight itself, not a widened fp32 copy hoisted out of the loop (which would read four times the bytes the int8
    weights hold, every step). Without `rows_product`'s barrier XLA hoists every one, so this can fail."""
    from amphista_jax.drafters.draft_model import DraftModel

    params = split_layers(init_params(CONFIG, jax.random.key(0)))
    drafter = DraftModel(CONFIG, weights="int8")
    layer = params["layer_0"]
    shapes = {f"{p['weight'].shape[0]},{p['weight'].shape[1]}]" for p in (*layer["attn"].values(),
                                                                        *layer["mlp"].values())}
    tokens, lengths = pad_prompts(PROMPTS[:1])
    hlo = decode.lower(params, drafter.kept_params(params), tokens, lengths, jax.random.key(0),
                       spec=DecodeSpec(CONFIG, drafter, chain(3), 8), cache_size=tokens.shape[1] + 16
                       ).compile().as_text()
    comps, in_loop = computations(hlo), loop_computations(hlo)
    assert all(any(f"s8[{s}" in comps[name] for name in in_loop) for s in shapes)
