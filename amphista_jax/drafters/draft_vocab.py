"""Draft vocabularies (EAGLE-3's `d2t`): heads that score only `V_d` candidate tokens, ids mapped back.

A drafter's `draft_vocab` setting is the sorted target ids of its candidates (`()` = the whole vocabulary). Its
heads project onto `V_d` columns of the vocabulary projection (`lm_head[:, draft_vocab]`, `[D, V_d]`) instead of
`V`, so a drafted depth reads `V_d x D` weights; their top-k indices over `V_d` are mapped back to target ids
(`to_target`) before anything else sees them. Decoding stays lossless: the target verifies every draft; a token
outside the draft vocabulary is simply never drafted (the target's own bonus token still commits it).

Training maps each label (a target id) to its draft index (`to_draft`); a label outside the draft vocabulary
cannot be drafted, so its position is left out of the CE mean and counts as a miss in top-1/top-5 (EAGLE-3
masks such positions the same way). The teacher (Amphista's alignment, Hydra++'s and EAGLE's teacher terms) is
the target's logits restricted to the draft vocabulary and renormalised (`restrict`), as EAGLE-3 does.

`most_frequent(token_counts(...), n)` chooses a vocabulary: the `n` most frequent label tokens of the training
data, ties by id (`amphista-jax train` with `draft_vocab_size: n`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DraftVocab = tuple[int, ...]  # sorted, distinct target ids; () = the whole vocabulary


def normalise(draft_vocab: Iterable[int]) -> DraftVocab:
    """`draft_vocab` as a drafter stores it (a tuple of ints: lists read back from draft.json become tuples);
    raises `ValueError` unless its ids are sorted, distinct and >= 0."""
    ids = tuple(int(i) for i in draft_vocab)
    if ids and (ids[0] < 0 or any(a >= b for a, b in zip(ids, ids[1:], strict=False))):
        raise ValueError(f"draft_vocab ({len(ids)} ids from {ids[0]}) must be sorted, distinct target ids >= 0")
    return ids


def normalise_field(drafter: Any) -> None:
    """In a frozen drafter's `__post_init__`: store its `draft_vocab` setting normalised (`normalise`)."""
    object.__setattr__(drafter, "draft_vocab", normalise(drafter.draft_vocab))


def check_fits(draft_vocab: DraftVocab, vocab_size: int) -> None:
    """Raise `ValueError` unless every id of `draft_vocab` is a token of a `vocab_size`-token target."""
    if draft_vocab and draft_vocab[-1] >= vocab_size:
        raise ValueError(f"draft_vocab holds token id {draft_vocab[-1]}, outside the target's {vocab_size} tokens: "
                         "choose it for this target")


def _ids(draft_vocab: DraftVocab) -> jax.Array:
    return jnp.asarray(np.asarray(draft_vocab, np.int32))  # [V_d] a constant of the compiled program


def target_ids(draft_vocab: DraftVocab) -> jax.Array | None:
    """`[V_d]` the target id of each draft index (`trees.growth`'s `root_ids`); None for the whole vocabulary."""
    return _ids(draft_vocab) if draft_vocab else None


def project_columns(lm_head: jax.Array, draft_vocab: DraftVocab) -> jax.Array:
    """The vocabulary projection `[..., D, V]` cut to the draft vocabulary's columns `[..., D, V_d]` (itself for
    the whole vocabulary)."""
    check_fits(draft_vocab, lm_head.shape[-1])
    return jnp.take(lm_head, _ids(draft_vocab), axis=-1) if draft_vocab else lm_head


def restrict(logits: jax.Array, draft_vocab: DraftVocab) -> jax.Array:
    """Target logits `[..., V]` restricted to the draft vocabulary `[..., V_d]` (a softmax over them renormalises).
    Logits already `V_d` wide are over it and pass unchanged: the train step's target logits, where a label store
    gives the greedy labels, are computed for the draft vocabulary's columns only (`train.step.target_forward`)."""
    if draft_vocab and logits.shape[-1] == len(draft_vocab):
        return logits
    return project_columns(logits, draft_vocab)


def to_target(indices: jax.Array, draft_vocab: DraftVocab) -> jax.Array:
    """Draft indices (any shape, values in `[0, V_d)`) -> target token ids of the same shape."""
    return _ids(draft_vocab)[indices] if draft_vocab else indices


def to_vocab(probs: jax.Array, draft_vocab: DraftVocab, vocab_size: int) -> jax.Array:
    """A distribution over the draft vocabulary `[..., V_d]` as one over the target's `[..., V]` (zero outside)."""
    if not draft_vocab:
        return probs
    return jnp.zeros(probs.shape[:-1] + (vocab_size,), probs.dtype).at[..., _ids(draft_vocab)].set(probs)


def to_draft(labels: jax.Array, draft_vocab: DraftVocab) -> tuple[jax.Array, jax.Array]:
    """Target ids `labels [...]` -> (draft indices, `inside` bool mask) of the same shape; a label outside the
    draft vocabulary gets index 0 and `inside` False (callers mask it)."""
    if not draft_vocab:
        return labels, jnp.ones(labels.shape, bool)
    ids = _ids(draft_vocab)
    index = jnp.minimum(jnp.searchsorted(ids, labels), len(draft_vocab) - 1).astype(jnp.int32)
    inside = ids[index] == labels
    return jnp.where(inside, index, 0), inside


def token_counts(tokens: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """`[V]` how often each token is a training label: `tokens [..., T]` where `loss_mask [..., T]` is 1. The heads
    draft tokens t + 2 + k from position t, each of which is itself a loss token of the same sequence, so the
    label tokens are exactly what the heads predict."""
    return np.bincount(np.asarray(tokens)[np.asarray(loss_mask) > 0].ravel(), minlength=vocab_size)[:vocab_size]


def most_frequent(counts: Sequence[int] | np.ndarray, n: int) -> DraftVocab:
    """The `n` most frequent token ids of `counts [V]` (ties: the lower id first), sorted: a draft vocabulary."""
    counts = np.asarray(counts)
    if not 1 <= n <= len(counts):
        raise ValueError(f"draft_vocab_size={n} must be in [1, {len(counts)}] (the target's vocabulary)")
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count descending, then id ascending
    return tuple(int(i) for i in np.sort(order[:n]))
