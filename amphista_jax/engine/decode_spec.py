"""The decode spec: one frozen, hashable value that carries everything static about a decode, checked once.

A `DecodeSpec` names the target's config, the drafter and its tree (both None: autoregressive decoding), the
number of new tokens, the sampling and acceptance settings, the stop ids, the pad id and the attention backend. It
is the static argument of `decode.decode` (one jitted entry for AR and speculative decoding), so two equal specs
share a compiled program. Every range check of these settings lives here: `check_decode_settings` (what a
front-end can check before loading any weights) and `DecodeSpec.__post_init__` (all of them, the vocabulary
included, and the tree against the drafter: once per spec, not per step). Errors are `DecodeSpecError`s (one line,
naming the setting); the CLI names its flag for the setting.

The spec is also the one home of a decode's token budget: `cache_size(prompt_length)` is the slots a cache needs
for right-padded prompts of that length (the prompt, `max_new_tokens`, and the `scratch` slots a verify forward
writes past the committed ones: the tree's nodes and the drafter's extras). Every door that allocates a cache
(`Generator.run` / `stream`, the memory plans, the calibration's clock, the benchmarks) asks the spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from amphista_jax.drafters.base import Drafter
from amphista_jax.infra.errors import DecodeSpecError, UserError
from amphista_jax.models.attention import AttentionBackend
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Transformer, target_model
from amphista_jax.trees.sampling import SamplingConfig, is_whole
from amphista_jax.trees.tree import Tree
from amphista_jax.trees.verify import AcceptanceConfig

GREEDY = SamplingConfig()
DEFAULT_ACCEPTANCE = AcceptanceConfig()
MIN_BUCKET = 16  # prompts pad to the next power of two >= this many tokens


def bucket(length: int) -> int:
    """The padded prompt length of a `length`-token prompt: the next power of two, at least `MIN_BUCKET`."""
    return max(MIN_BUCKET, 1 << (max(length, 1) - 1).bit_length())


def scratch_slots(drafter: Drafter, tree: Tree) -> int:
    """Cache slots a verify forward writes past the committed ones: the tree's nodes and the drafter's extras."""
    return tree.num_nodes + drafter.num_extras(tree)


def check_decode_settings(max_new_tokens: Any, sampling: SamplingConfig, acceptance: AcceptanceConfig,
                          vocab_size: int | None = None) -> None:
    """Raise `DecodeSpecError` unless `max_new_tokens` is a whole number >= 1, `top_k` is at most `vocab_size`
    (where known) and the acceptance rule works at this temperature (the sampling settings' own ranges are
    `SamplingConfig`'s). What a front-end checks before loading weights; `DecodeSpec` checks it again, with the
    vocabulary."""
    if not is_whole(max_new_tokens) or max_new_tokens < 1:
        raise DecodeSpecError("max_new_tokens", max_new_tokens,
                              "must be >= 1" if is_whole(max_new_tokens) else "must be a whole number >= 1")
    if vocab_size is not None and sampling.top_k > vocab_size:
        raise DecodeSpecError("top_k", sampling.top_k, f"must be in [0, {vocab_size}]: larger than the vocabulary "
                              f"({vocab_size} tokens) filters nothing (0 = off)")
    try:
        acceptance.resolve(sampling)
    except UserError as e:
        raise DecodeSpecError("acceptance", acceptance.rule and acceptance.rule.value, str(e)) from None


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Everything static about one decode (hashable: the static argument under `jax.jit`), checked when made.
    `drafter` and `tree` are both None for autoregressive decoding. `eos_ids` may be given as any iterable of
    ids; it is kept as a tuple."""

    config: ModelConfig
    drafter: Drafter | None  # None: autoregressive decoding
    tree: Tree | None  # a static tree the drafter fills, or the budget of the trees it builds
    max_new_tokens: int
    sampling: SamplingConfig = GREEDY
    acceptance: AcceptanceConfig = DEFAULT_ACCEPTANCE
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    attention: str = "xla"

    def __post_init__(self) -> None:
        vocab = self.config.vocab_size
        check_decode_settings(self.max_new_tokens, self.sampling, self.acceptance, vocab)
        eos = tuple(self.eos_ids) if isinstance(self.eos_ids, Iterable) else (self.eos_ids,)
        if not all(is_whole(t) and 0 <= t < vocab for t in eos):
            raise DecodeSpecError("eos_ids", self.eos_ids, f"stop ids must be token ids in [0, {vocab})")
        object.__setattr__(self, "eos_ids", tuple(int(t) for t in eos))
        if not is_whole(self.pad_id):
            raise DecodeSpecError("pad_id", self.pad_id, "must be a whole number (what rows hold after they stop)")
        try:
            AttentionBackend.parse(self.attention)
        except UserError as e:
            raise DecodeSpecError("attention", self.attention, str(e)) from None
        if (self.drafter is None) != (self.tree is None):
            raise DecodeSpecError("tree", self.tree, "a drafter needs a tree and a tree a drafter: give both, or "
                                  "neither for autoregressive decoding")
        if self.drafter is not None:
            self.drafter.check_tree(self.tree, vocab)

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def scratch(self) -> int:
        """Cache slots a verify forward writes past the committed ones (0 for autoregressive decoding)."""
        return 0 if self.drafter is None else scratch_slots(self.drafter, self.tree)

    def cache_size(self, prompt_length: int) -> int:
        """Slots of a cache for right-padded prompts of `prompt_length` tokens: the prompt, the new tokens and the
        scratch slots (the number every door allocates, and the engine checks at trace time)."""
        return prompt_length + self.max_new_tokens + self.scratch

    @property
    def stat_shape(self) -> tuple[int, int]:
        """(D, R) of the tree statistics."""
        return max(self.tree.depth, 1), self.tree.num_ranks

    def model(self, params: dict) -> Transformer:
        """The target model that applies `params` (either layer layout)."""
        return target_model(self.config, params, self.attention)
