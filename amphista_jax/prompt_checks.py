"""Host-side checks of what the jitted decode functions take (`decode.generate`, `decode.speculative_generate`,
`Generator.run`): inside `jax.jit` a bad length or token id is not an error but a garbage completion, and another
drafter's params fail deep inside the trace, so prompts are checked before tracing and refused with a typed
`PromptError`, draft params against their drafter with a `DraftParamsError`."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import numpy as np

from amphista_jax.errors import UserError


class PromptError(UserError, ValueError):
    """Prompts the decode functions cannot read: not `[B, T]` integer token ids, lengths outside `[1, T]` or of
    another batch, ids outside the model's vocabulary."""


def check_prompts(prompt: Any, prompt_lengths: Any, vocab_size: int) -> None:
    """Raise `PromptError` (naming the fix) unless right-padded `prompt [B, T]` and `prompt_lengths [B]` are
    integer arrays whose lengths are in `[1, T]` and whose tokens (within each row's length) are ids of a
    `vocab_size`-token model. Values under tracing are not checked (shapes and dtypes still are)."""
    shape, dtype = np.shape(prompt), getattr(prompt, "dtype", np.asarray(prompt).dtype)
    if len(shape) != 2 or not np.issubdtype(dtype, np.integer):
        raise PromptError(f"prompts must be a [batch, length] integer array of token ids, not {dtype} of shape "
                          f"{shape}: pad them with decode.pad_prompts(list of token-id lists)")
    lshape, ldtype = np.shape(prompt_lengths), getattr(prompt_lengths, "dtype", np.asarray(prompt_lengths).dtype)
    if lshape != shape[:1] or not np.issubdtype(ldtype, np.integer):
        raise PromptError(f"prompt_lengths must be {shape[0]} integers (one per prompt row), not {ldtype} of shape "
                          f"{lshape}: pass the lengths pad_prompts returned with these prompts")
    if any(isinstance(x, jax.core.Tracer) for x in (prompt, prompt_lengths)):
        return
    tokens, lengths = np.asarray(prompt), np.asarray(prompt_lengths)
    if lengths.min() < 1 or lengths.max() > shape[1]:
        raise PromptError(f"prompt_lengths {lengths.tolist()} must be in [1, {shape[1]}] (the padded prompt width): "
                          "an empty prompt has nothing to continue; pad wider for longer prompts")
    inside = tokens[np.arange(shape[1])[None] < lengths[:, None]]
    if inside.min() < 0 or inside.max() >= vocab_size:
        bad = int(inside.max() if inside.max() >= vocab_size else inside.min())
        raise PromptError(f"prompt token id {bad} is outside the model's {vocab_size}-token vocabulary: encode the "
                          "prompts with this model's own tokenizer")


class DraftParamsError(UserError, ValueError):
    """Draft params that are not the drafter's: another method's or another setting's heads."""


@functools.lru_cache(maxsize=32)
def _expected_leaves(drafter: Any, config: Any, target: Any) -> tuple[dict[str, tuple[int, ...]], ...]:
    """({path: shape} of each param tree `drafter` decodes with, `Drafter.param_trees`) for a target of `config`
    (its params' abstract shapes `target`)."""
    from amphista_jax.target import Target

    params = jax.tree.unflatten(target[0], [jax.ShapeDtypeStruct(s, d) for s, d in target[1]])
    return tuple(_leaf_shapes(t) for t in drafter.param_trees(Target(config, params)))


def _leaf_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    return {jax.tree_util.keystr(k): tuple(np.shape(v)) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_draft_params(drafter: Any, draft_params: Any, config: Any, params: Any) -> None:
    """Raise `DraftParamsError` unless `draft_params` has the leaves and shapes of a param tree the drafter decodes
    with on this target (`Drafter.param_trees`; dtypes may differ: heads are stored in bf16 or fp32)."""
    leaves, treedef = jax.tree.flatten(params)
    target = (treedef, tuple((tuple(np.shape(x)), x.dtype) for x in leaves))
    if not (trees := _expected_leaves(drafter, config, target)):
        return  # nothing to check against
    given = _leaf_shapes(draft_params)
    if given in trees:
        return
    expected, name = trees[0], type(drafter).__name__
    missing, extra = sorted(expected.keys() - given.keys()), sorted(given.keys() - expected.keys())
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
        what += f" (+{len(missing) + len(extra) - 1} more)" if len(missing) + len(extra) > 1 else ""
    else:
        key = next(k for k in sorted(expected) if expected[k] != given[k])
        what = f"{key} has shape {given[key]}, {name} makes {expected[key]}"
    raise DraftParamsError(f"draft_params are not {name}'s params for this target ({what}): pass the params "
                           "made for this drafter, e.g. both from drafters.io.load_draft(heads_dir, ...)")


class HostChecked:
    """A jitted decode entry point that checks its prompts on the host first (`check_prompts`); `lower` (abstract
    shapes: how `plan` and `Generator` compile it) passes straight through."""

    def __init__(self, jitted: Any):
        self.jitted, self.lower = jitted, jitted.lower
        self.signature = inspect.signature(jitted)
        functools.update_wrapper(self, jitted)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # static arguments must hash: a list of stop ids is taken as the tuple it means
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
        bound = self.signature.bind(*args, **kwargs).arguments
        check_prompts(bound["prompt"], bound["prompt_lengths"], bound["config"].vocab_size)
        if "drafter" in bound:
            check_draft_params(bound["drafter"], bound["draft_params"], bound["config"], bound["params"])
        return self.jitted(*args, **kwargs)
