"""The losses and metrics the drafters' `loss` methods share: per-head CE and accuracy, the LM and teacher terms of
Medusa-style heads, the KL to the target's distribution (whole, or its stored top-k), and the labels a batch carries.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import optax

from amphista_jax.drafters.draft_vocab import DraftVocab, restrict, to_draft


def unstack(x: jax.Array, axis: int) -> list[jax.Array]:
    """`x`'s slices along `axis` (that axis dropped), by one split whose gradient is one concatenation. Indexing
    slice k out of `x` instead makes each slice's gradient a padded copy of all of `x`, and the train step sums
    them: with heads' logits `[B, T, K, V_d]` that was a third to half of Medusa's, Hydra's and EAGLE-3's train step
    on XLA:CPU."""
    return [part.squeeze(axis) for part in jax.numpy.split(x, x.shape[axis], axis=axis)]


def head_metrics(logits: jax.Array, labels: jax.Array, mask: jax.Array,
                 draft_vocab: DraftVocab = ()) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked mean CE and top-1 / top-5 accuracy of one head: `logits [B, T, V_d]` over `draft_vocab`, target
    ids `labels` and `mask [B, T]`. A label outside the draft vocabulary is left out of the CE mean and counts
    as a miss in top-1 / top-5."""
    labels, inside = to_draft(labels, draft_vocab)
    kept = mask * inside
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    denom = jax.numpy.maximum(mask.sum(), 1.0)
    # The label's rank = how many logits beat it. XLA:CPU lowers `top_k` inside this fusion to a full sort
    # (~40x slower per training step); a comparison count is one pass over the vocabulary.
    rank = (logits > jax.numpy.take_along_axis(logits, labels[..., None], axis=-1)).sum(-1)  # [B, T]
    loss = (ce * kept).sum() / jax.numpy.maximum(kept.sum(), 1.0)
    return loss, {"loss": loss, "top1": ((rank == 0) * kept).sum() / denom,
                  "top5": ((rank < 5) * kept).sum() / denom}


def head_losses(logits: jax.Array, batch: dict, lm_weights: Sequence[float], teacher_logits: jax.Array | None = None,
                teacher_weight: float | Sequence[float] = 0.0, teacher_name: str = "teacher",
                draft_vocab: DraftVocab = ()) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The draft-head objective every head method shares: head k (0-based) at position t drafts token t + 2 + k, which
    the target predicts at t + 1 + k. `logits [B, T, K, V_d]` (over `draft_vocab`, see `head_metrics` and
    `teacher_ce`); `batch` holds `tokens` and `loss_mask [B, T]`, and the labels `batch_labels` and `target_kl`
    read (`loss.labels: target`, `loss.kind: kl`): with them each head's LM term is the CE against the target's
    own greedy token, or the KL to the target's distribution. Returns the sum over heads of `lm_weights[k] *
    CE(truth)` (+ `teacher_weight * CE(softmax(teacher_logits))` when the target's `teacher_logits [B, T, V]` are
    given; one weight, or one per head) and per-head metrics: `head{k}/loss`, `top1`, `top5`, `agree` (top-1 against
    the target's greedy token, when the batch has it), `kl` and `head{k}/<teacher_name>`."""
    tokens, mask = batch["tokens"], batch["loss_mask"].astype(jax.numpy.float32)
    labels = batch_labels(batch)
    t = tokens.shape[1]
    total, metrics = 0.0, {}
    for k, head_logits in enumerate(unstack(logits, 2)):
        shift = k + 2
        lk, m = head_logits[:, : t - shift], mask[:, shift:]
        lm, head = head_metrics(lk, labels[:, shift:], m, draft_vocab)
        if lm_weights[k] and (kl := target_kl(lk, batch, shift - 1, m, draft_vocab)) is not None:
            lm = head["kl"] = kl
        if "greedy" in batch:  # agreement with the target's own greedy token: the figure that sets tau
            head["agree"] = head_metrics(lk, batch["greedy"][:, shift:], m, draft_vocab)[1]["top1"]
        total = total + lm_weights[k] * lm
        metrics |= {f"head{k}/{name}": v for name, v in head.items()}
        if teacher_logits is not None:
            teacher = teacher_ce(lk, teacher_logits[:, shift - 1: t - 1], m, draft_vocab)
            total = total + (teacher_weight[k] if isinstance(teacher_weight, Sequence) else teacher_weight) * teacher
            metrics[f"head{k}/{teacher_name}"] = teacher
    return total, metrics


def check_loss_weights(**weights: float) -> None:
    """A loss's term weights, by setting name: each >= 0, not all 0."""
    if min(weights.values()) < 0 or sum(weights.values()) == 0:
        raise ValueError(f"loss weights {', '.join(f'{k}={v}' for k, v in weights.items())} must be >= 0, not all 0")


def batch_labels(batch: dict) -> jax.Array:
    """`[B, T]` the token each position should hold: the data's (`tokens`), or with `loss.labels: target` the
    target's own greedy choice there (`labels`, made by the train step from the target's logits or label store)."""
    return batch.get("labels", batch["tokens"])


def target_kl(logits: jax.Array, batch: dict, start: int, mask: jax.Array, draft_vocab: DraftVocab = ()
              ) -> jax.Array | None:
    """With `loss.kind: kl`, the masked mean KL(target || draft) of draft `logits [B, T', V_d]` whose position t
    drafts what the target predicts at position `start + t`; None otherwise (the LM term stays a CE on
    `batch_labels`). The target's distribution is the label store's top-k log-probs with the rest of its mass as
    one bucket (`label_ids`, `label_logp [B, T, k]`: `topk_kl`), or its whole softmax (`label_logits [B, T, V]`),
    restricted to the draft vocabulary either way."""
    n = logits.shape[1]
    if "label_logp" in batch:
        return topk_kl(logits, batch["label_ids"][:, start: start + n], batch["label_logp"][:, start: start + n],
                       mask, draft_vocab)
    if "label_logits" in batch:
        teacher = jax.nn.log_softmax(restrict(batch["label_logits"][:, start: start + n], draft_vocab), axis=-1)
        draft = jax.nn.log_softmax(logits, axis=-1)
        kl = (jax.numpy.exp(teacher) * (teacher - draft)).sum(-1)
        return (kl * mask).sum() / jax.numpy.maximum(mask.sum(), 1.0)
    return None


def topk_kl(logits: jax.Array, ids: jax.Array, logp: jax.Array, mask: jax.Array, draft_vocab: DraftVocab = ()
            ) -> jax.Array:
    """Masked mean KL(p || q) over k + 1 outcomes: the target's top-k tokens `ids [B, T, k]` with log-probs `logp`
    and "any other token" with the rest of its mass, against the draft's softmax over `logits [B, T, V_d]` on the
    same outcomes (its mass outside the k ids, a log-sum-exp over the others: finite for k < V_d). Top-k ids
    outside the draft vocabulary are dropped and the target's distribution renormalised over what is left."""
    idx, inside = to_draft(ids, draft_vocab)
    q = jax.nn.log_softmax(logits, axis=-1)  # [B, T, V_d]
    q_top = jax.numpy.take_along_axis(q, idx, axis=-1)  # [B, T, k]
    p_top = jax.numpy.where(inside, jax.numpy.exp(logp), 0.0)
    p_rest = jax.numpy.maximum(1.0 - jax.numpy.exp(logp).sum(-1), 0.0)  # [B, T]
    norm = p_top.sum(-1) + p_rest
    p_top, p_rest = p_top / norm[..., None], p_rest / norm
    # the draft's log-mass outside the kept ids (an id outside the draft vocabulary scatters nowhere)
    kept = jax.numpy.where(inside, idx, q.shape[-1])
    others = jax.vmap(jax.vmap(lambda row, i: row.at[i].set(-jax.numpy.inf, mode="drop")))(q, kept)
    q_rest = jax.nn.logsumexp(others, axis=-1)  # [B, T]
    xlogy = jax.scipy.special.xlogy
    kl = (xlogy(p_top, p_top) - p_top * jax.numpy.where(inside, q_top, 0.0)).sum(-1) + xlogy(p_rest, p_rest) \
        - p_rest * jax.numpy.where(jax.numpy.isfinite(q_rest), q_rest, 0.0)
    return (kl * mask).sum() / jax.numpy.maximum(mask.sum(), 1.0)


def teacher_ce(logits: jax.Array, teacher_logits: jax.Array, mask: jax.Array,
               draft_vocab: DraftVocab = ()) -> jax.Array:
    """Masked mean CE of draft `logits [B, T, V_d]` against the target's softmax over `teacher_logits [B, T, V]`
    restricted to `draft_vocab` (renormalised; teacher distillation: Amphista's alignment term, Hydra++'s teacher
    loss); `mask [B, T]`."""
    teacher = jax.nn.softmax(restrict(teacher_logits, draft_vocab), axis=-1)
    return (optax.softmax_cross_entropy(logits, teacher) * mask).sum() / jax.numpy.maximum(mask.sum(), 1.0)
