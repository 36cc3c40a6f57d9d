"""Host-side checks of what the jitted decode entry takes (`decode.decode`, its wrappers and `Generator.run`, calls
and `.lower` alike): inside `jax.jit` a bad length or token id is not an error but a garbage completion, and another
drafter's params fail deep inside the trace, so `check_decode_inputs` runs before tracing and refuses with a typed
`PromptError`, `PromptTooLongError` or `DraftParamsError`. The decode settings themselves are checked where they
are made (`decode_spec.DecodeSpec`)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import numpy as np

from amphista_jax.infra.errors import UserError
from amphista_jax.models.config import ModelConfig


class PromptTooLongError(UserError, ValueError):
    """A prompt that does not fit in the cache together with the tokens to generate."""


class PromptError(UserError, ValueError):
    """Prompts the decode functions cannot read: not `[B, T]` integer token ids, lengths outside `[1, T]` or of
    another batch, ids outside the model's vocabulary."""


def check_prompts(prompt: Any, prompt_lengths: Any, vocab_size: int) -> None:
    """Raise `PromptError` (naming the fix) unless right-padded `prompt [B, T]` and `prompt_lengths [B]` are
    integer arrays whose lengths are in `[1, T]` and whose tokens (within each row's length) are ids of a
    `vocab_size`-token model. Values under tracing are not checked (shapes and dtypes still are)."""
    shape, dtype = _shape_dtype(prompt)
    if len(shape) != 2 or not np.issubdtype(dtype, np.integer):
        raise PromptError(f"prompts must be a [batch, length] integer array of token ids, not {dtype} of shape "
                          f"{shape}: pad them with decode.pad_prompts(list of token-id lists)")
    lshape, ldtype = _shape_dtype(prompt_lengths)
    if lshape != shape[:1] or not np.issubdtype(ldtype, np.integer):
        raise PromptError(f"prompt_lengths must be {shape[0]} integers (one per prompt row), not {ldtype} of shape "
                          f"{lshape}: pass the lengths pad_prompts returned with these prompts")
    if not all(_concrete(x) for x in (prompt, prompt_lengths)):
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


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of an array, a nested list or an abstract `jax.ShapeDtypeStruct`."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(x.shape), np.dtype(x.dtype)
    a = np.asarray(x)
    return a.shape, a.dtype


def _concrete(x: Any) -> bool:
    """Whether `x` holds values (not a tracer nor an abstract shape)."""
    return not isinstance(x, jax.core.Tracer | jax.ShapeDtypeStruct)


def check_fits(prompt_lengths: np.ndarray, max_new_tokens: int, cache_size: int,
               config: ModelConfig | None = None) -> None:
    """Raise `PromptTooLongError` unless every prompt plus `max_new_tokens` fits in `cache_size` slots and,
    given the target's `config`, in the positions it was trained for."""
    longest = int(np.max(prompt_lengths))
    if max_new_tokens < 1:
        raise PromptTooLongError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if config is not None and longest + max_new_tokens > config.max_positions:
        raise PromptTooLongError(
            f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} reaches position "
            f"{longest + max_new_tokens} but the model was trained for {config.max_positions} positions "
            "(max_position_embeddings with its rope scaling): shorten the prompt or lower --max-new-tokens")
    if longest + max_new_tokens > cache_size:
        raise PromptTooLongError(
            f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} needs {longest + max_new_tokens} "
            f"cache slots but the cache has {cache_size}: shorten the prompt, lower --max-new-tokens or raise "
            "--max-len")



class DraftParamsError(UserError, ValueError):
    """Draft params that are not the drafter's: another method's or another setting's heads."""


@functools.lru_cache(maxsize=32)
def _expected_leaves(drafter: Any, config: Any, target: Any) -> tuple[dict[str, tuple[int, ...]], ...]:
    """({path: shape} of each param tree `drafter` decodes with, `Drafter.param_trees`) for a target of `config`
    (its params' abstract shapes `target`)."""
    from amphista_jax.models.target import Target

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


def check_decode_inputs(spec: Any, params: Any, draft_params: Any, prompt: Any, prompt_lengths: Any,
                        draft: bool = True) -> None:
    """Every host check of one decode's inputs, for every door (`decode.decode` called or lowered, its wrappers,
    `Generator.run` and `stream`): the prompts (`check_prompts`), their positions against the target's
    (`check_fits`; the cache itself is checked at trace time) and, with `draft`, the draft params against
    `spec.drafter` (`check_draft_params`). Abstract prompts (`jax.ShapeDtypeStruct`s) are checked for shapes and
    dtypes only."""
    check_prompts(prompt, prompt_lengths, spec.config.vocab_size)
    if _concrete(prompt_lengths):
        check_fits(np.asarray(prompt_lengths), spec.max_new_tokens, _shape_dtype(prompt)[0][1] + spec.max_new_tokens,
                   spec.config)
    if draft and spec.drafter is not None:
        check_draft_params(spec.drafter, draft_params, spec.config, params)


class HostChecked:
    """The jitted decode entry with `check_decode_inputs` run first, whether it is called or lowered. `lower` (how
    `plan` and `Generator` compile it, often under a mesh, on abstract shapes) checks the prompts only: lowering
    traces the draft params against the drafter anyway, and `Generator.run` checks them before it lowers."""

    def __init__(self, jitted: Any):
        self.jitted = jitted
        self.signature = inspect.signature(jitted)
        functools.update_wrapper(self, jitted)

    def _check(self, args: tuple, kwargs: dict, draft: bool) -> None:
        bound = self.signature.bind(*args, **kwargs).arguments
        check_decode_inputs(bound["spec"], bound["params"], bound["draft_params"], bound["prompt"],
                            bound["prompt_lengths"], draft)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check(args, kwargs, draft=True)
        return self.jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        self._check(args, kwargs, draft=False)
        return self.jitted.lower(*args, **kwargs)
