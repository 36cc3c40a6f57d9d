"""Batches grouped by length: every example once an epoch, each batch cut at its longest row, an exact resume, and
a cut batch training every method exactly as its full-length batch does."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.drafters import VARIANTS, BiTA
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import Transformer, init_params
from amphista_jax.models.target import Target
from amphista_jax.train import data
from amphista_jax.train.config import DataConfig, TrainConfig
from amphista_jax.train.data import bucket_cut, length_grouped_dataset, trained_lengths
from amphista_jax.train.heads import train_dataset
from amphista_jax.train.optim import OptimConfig, make_optimizer
from amphista_jax.train.step import make_steps
from tests.helpers import default_cases

CONFIG = tiny_llama_config(vocab_size=256)


def _examples(n: int, t: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`n` examples of `t` positions: row i's tokens start at i * t; a prompt position, then an answer of a random
    length, then padding."""
    ends = np.random.default_rng(seed).integers(2, t + 1, n)
    return [{"tokens": np.arange(i * t, (i + 1) * t, dtype=np.int32),
             "loss_mask": ((np.arange(t) >= 1) & (np.arange(t) < end)).astype(np.int32)} for i, end in enumerate(ends)]


def test_grouped_batches_hold_each_example_once_an_epoch_cut_at_their_longest_row(monkeypatch):
    monkeypatch.setattr(data, "LENGTH_BUCKET", 4)
    examples = _examples(48, 16)
    lengths = trained_lengths(examples)
    assert lengths.tolist() == [int(np.flatnonzero(e["loss_mask"]).max()) + 1 for e in examples]
    ds = length_grouped_dataset(examples, lengths, 16, 4, seed=3, groups=3)
    it = iter(ds)
    epochs = [[next(it) for _ in range(12)] for _ in range(2)]  # 48 examples: 12 batches an epoch, 4 groups of 3
    for batches in epochs:
        ids = np.concatenate([b["tokens"][:, 0] // 16 for b in batches])
        assert sorted(ids.tolist()) == list(range(48))  # every example once
        for b in batches:
            rows = b["tokens"][:, 0] // 16
            cut = bucket_cut(int(lengths[rows].max()), 16)
            assert b["tokens"].shape == b["loss_mask"].shape == (4, cut) and cut % 4 == 0
            np.testing.assert_array_equal(b["loss_mask"], np.stack([examples[i]["loss_mask"][:cut] for i in rows]))
        for group in range(4):  # within a group the batches hold disjoint, sorted ranges of lengths
            spans = sorted((lengths[b["tokens"][:, 0] // 16].min(), lengths[b["tokens"][:, 0] // 16].max())
                           for b in batches[3 * group: 3 * group + 3])
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert len({b["tokens"].shape[1] for b in epochs[0]}) > 1  # several cuts, not max_len everywhere
    first = [b["tokens"][:, 0].tolist() for b in epochs[0]]
    members = [[set(np.concatenate([b["tokens"][:, 0] for b in batches[3 * g: 3 * g + 3]]).tolist()) for g in range(4)]
               for batches in epochs]
    assert members[0] != members[1]  # the next epoch groups other examples together
    again = iter(ds)  # a resume from the iterator's state yields the same batches
    for _ in range(5):
        next(again)
    state = again.get_state()
    resumed = iter(length_grouped_dataset(examples, lengths, 16, 4, seed=3, groups=3))
    resumed.set_state(state)
    assert [next(resumed)["tokens"][:, 0].tolist() for _ in range(4)] == first[5:9]
    halves = [iter(length_grouped_dataset(examples, lengths, 16, 4, seed=3, groups=3, rows=r))
              for r in (slice(0, 2), slice(2, 4))]  # two processes' rows make the global batch
    np.testing.assert_array_equal(np.concatenate([next(h)["tokens"] for h in halves]), epochs[0][0]["tokens"])
    cfg = DataConfig(kind="sharegpt", train="x", max_len=16, batch_size=4, seed=3, length_groups=3)
    trained = iter(train_dataset(examples, lengths, cfg, slice(None)))  # what `amphista-jax train` reads
    assert [next(trained)["tokens"][:, 0].tolist() for _ in range(12)] == first
    with pytest.raises(ValueError, match="data.length_groups=-1 must be an integer >= 0"):
        DataConfig(kind="sharegpt", train="x", length_groups=-1)
    with pytest.raises(ValueError, match="BiTA's drafter.train_groups cut points depend on the batch's length"):
        TrainConfig(data=DataConfig(kind="sharegpt", train="x", length_groups=2), drafter=BiTA(train_groups=8))


TRAINABLE = [m for m in VARIANTS if VARIANTS[m].trainable]


@pytest.mark.parametrize("method", TRAINABLE)
# EAGLE-3 (training-time test: its own outputs shifted depth by depth) and Medusa (a head per depth); every other
# method under -m slow.
@default_cases("eagle3", "medusa")
def test_a_batch_cut_after_its_last_trained_position_trains_alike(method):
    """No loss reads a position after a row's last trained one: the batch cut there gives the full-length batch's
    metrics and update (to fp32 rounding). Draws of the batch's shape give a cut batch other, equally distributed
    values: EAGLE's and Gumiho's feature noise is off here, and DFlash's 16 anchors cover every trainable position
    of these rows. BiTA's default (a mask group at every cut point) is tested; `train_groups` > 0 is refused with
    length groups (its cut points depend on the batch's length)."""
    params = init_params(CONFIG, jax.random.key(0))
    drafter = VARIANTS[method]
    if hasattr(drafter, "feature_noise"):
        drafter = dataclasses.replace(drafter, feature_noise=0.0)
    optimizer = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=1), 10)
    examples = _examples(4, 32, seed=5)
    for e in examples:
        e["loss_mask"][16:] = 0  # every row trained up to position 15 at most
    batch = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
    cut = {k: v[:, :16] for k, v in batch.items()}
    step, evaluate = make_steps(Transformer(CONFIG), drafter, optimizer)
    runs = []
    for b in (batch, cut):
        draft = drafter.init(jax.random.key(1), Target(CONFIG, params))  # the step donates its state
        state = {"params": draft, "opt_state": optimizer.init(draft), "step": jnp.zeros((), jnp.int32)}
        new, metrics = step(state, params, b)
        runs.append((new["params"], metrics, evaluate(new["params"], params, b)))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6),
                 runs[0], runs[1])
    assert float(runs[0][1]["loss"]) > 0
