"""Labels from the target: the label store's top-k log-probs are the target's own, the KL to them is the KL, and the
train step hands the drafters the labels `loss` asks for."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from amphista_jax.drafters import DRAFTERS
from amphista_jax.drafters.losses import head_losses, target_kl, topk_kl
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import Transformer, init_params
from amphista_jax.models.target import Target
from amphista_jax.train import data
from amphista_jax.train.config import DataConfig, LossConfig, TrainConfigError, check_store_layers
from amphista_jax.train.examples import with_hidden
from amphista_jax.train.step import target_forward, with_target_labels
from tests.helpers import default_cases

CONFIG = tiny_llama_config()
DEEP = tiny_llama_config(num_layers=4)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_the_label_store_holds_the_targets_own_top_k(tmp_path):
    params = init_params(CONFIG, jax.random.key(0))
    model = Transformer(CONFIG)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (3, 12)).astype(np.int32)
    examples = [{"tokens": t, "loss_mask": np.ones_like(t)} for t in tokens]
    stored = with_hidden(examples, model, params, 2, tmp_path, "tiny", label_top_k=5)
    logits = np.asarray(model.apply({"params": params}, jnp.asarray(tokens),
                                    jnp.broadcast_to(jnp.arange(12), (3, 12))).logits, np.float64)
    want = _log_softmax(logits)
    for row, e in enumerate(stored):
        order = np.argsort(-want[row], axis=-1, kind="stable")[:, :5]
        np.testing.assert_array_equal(e["label_ids"], order)
        np.testing.assert_allclose(e["label_logp"], np.take_along_axis(want[row], order, -1), atol=1e-5)
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["hidden", "label_ids", "label_logp"]
    again = with_hidden(examples, model, params, 2, tmp_path, "tiny", label_top_k=5)  # read back, not recomputed
    assert isinstance(again[0]["label_logp"], np.memmap)
    np.testing.assert_array_equal(again[1]["label_ids"], stored[1]["label_ids"])


def test_a_killed_store_pass_resumes_where_it_recorded(tmp_path, monkeypatch, capsys):
    """A pass killed after recording 4 of 7 rows resumes at row 4 into the same `.partial` files, and the store
    then equals the states computed in one go in memory."""
    from amphista_jax.train import examples as ex

    params, model = init_params(DEEP, jax.random.key(0)), Transformer(DEEP)
    tokens = np.random.default_rng(2).integers(0, DEEP.vocab_size, (7, 9)).astype(np.int32)
    lengths = [9, 3, 7, 2, 9, 5, 4]  # the pass runs shortest first: its order is not the rows'
    examples = [{"tokens": t, "loss_mask": (np.arange(9) < n).astype(np.int32)}
                for t, n in zip(tokens, lengths, strict=True)]
    monkeypatch.setattr(data, "LENGTH_BUCKET", 4)
    want = ex.with_hidden(examples, model, params, 2, "", None, (1, 3), label_top_k=3)  # in memory
    monkeypatch.setattr(ex, "SAVE_EVERY_S", -1.0)  # record after every batch
    record, calls = ex._record, []

    def killed_after_two(*args):
        record(*args)
        calls.append(args[-1])
        if len(calls) == 2:
            raise KeyboardInterrupt  # the kill, right after the second record

    monkeypatch.setattr(ex, "_record", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        ex.with_hidden(examples, model, params, 2, tmp_path, "tiny", (1, 3), label_top_k=3)
    assert calls == [2, 4] and not list(tmp_path.glob("*.npy"))  # nothing complete under a final name
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("*.partial0")) == [
        "captured", "hidden", "label_ids", "label_logp"]
    monkeypatch.setattr(ex, "_record", record)
    got = ex.with_hidden(examples, model, params, 2, tmp_path, "tiny", (1, 3), label_top_k=3)
    assert "resuming a killed pass at row 4 of 7" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".npy")) == []  # no partial, no lock
    for name in ("hidden", "captured", "label_ids", "label_logp"):
        np.testing.assert_array_equal(np.stack([e[name] for e in got]), np.stack([e[name] for e in want]),
                                      err_msg=name)
    hidden = next(tmp_path.glob("hidden-*.npy"))
    leftover = hidden.with_name(hidden.name + ".partial0")  # a killed pass of this process that another completed
    leftover.write_bytes(b"x")
    ex.with_hidden(examples, model, params, 2, tmp_path, "tiny", (1, 3), label_top_k=3)
    assert not leftover.exists()


def test_a_store_pass_cut_at_each_batchs_longest_row_keeps_the_targets_states(tmp_path, monkeypatch):
    """The pass runs rows shortest first and cuts each batch at its longest row (rounded up to the bucket): every
    row's states up to its last trained position equal the full-length forward's, the padding after it repeats the
    last position computed, and each cut compiles once."""
    from amphista_jax.train import examples as ex

    params, model = init_params(DEEP, jax.random.key(0)), Transformer(DEEP)
    tokens = np.random.default_rng(4).integers(0, DEEP.vocab_size, (6, 12)).astype(np.int32)
    lengths = [12, 2, 7, 3, 8, 11]  # batches of 2, shortest first: (2, 3) cut at 4, (7, 8) at 8, (11, 12) at 12
    masks = [(np.arange(12) >= 1) & (np.arange(12) < n) for n in lengths]  # a prompt position, then the answer
    examples = [{"tokens": t, "loss_mask": m.astype(np.int32)} for t, m in zip(tokens, masks, strict=True)]
    monkeypatch.setattr(data, "LENGTH_BUCKET", 4)
    cuts = []
    forward = ex.target_states
    monkeypatch.setattr(ex, "target_states", lambda *a, **k: cuts.append(a[2].shape) or forward(*a, **k))
    got = with_hidden(examples, model, params, 2, tmp_path, "tiny", (1, 3), label_top_k=3)
    assert cuts == [(2, 4), (2, 8), (2, 12)]  # traced once per cut
    out = target_forward(model, params, {"tokens": jnp.asarray(tokens)}, (1, 3))
    want = _log_softmax(np.asarray(out.logits, np.float64))
    batch_cut = {1: 4, 3: 4, 2: 8, 4: 8, 5: 12, 0: 12}  # row: its batch's cut
    for row, e in enumerate(got):
        cut = batch_cut[row]  # the full-length forward's states up to it, its last position's after it
        np.testing.assert_allclose(e["hidden"][:cut], np.asarray(out.hidden[row, :cut]), atol=2e-3)
        np.testing.assert_allclose(e["captured"][:cut], np.asarray(out.captured[row, :cut]), atol=2e-3)
        order = np.argsort(-want[row, :cut], axis=-1, kind="stable")[:, :3]
        np.testing.assert_array_equal(e["label_ids"][:cut], order)
        for name in ("hidden", "captured", "label_ids", "label_logp"):
            np.testing.assert_array_equal(e[name][cut:], np.broadcast_to(e[name][cut - 1], e[name][cut:].shape))
    longer = [e | {"loss_mask": np.ones_like(e["loss_mask"])} for e in examples]  # the same tokens, other cuts
    with_hidden(longer, model, params, 2, tmp_path, "tiny", (1, 3), label_top_k=3)
    assert len(list(tmp_path.glob("hidden-*.npy"))) == 2  # a store of its own, not the one cut shorter


def test_methods_with_different_layers_share_one_store_file(tmp_path, capsys):
    """With `store_layers`, the store keeps those layers' inputs once, and each method reads its own layers'
    columns, in its own order: equal to the target's inputs of those layers."""
    params, model = init_params(DEEP, jax.random.key(0)), Transformer(DEEP)
    tokens = np.random.default_rng(3).integers(0, DEEP.vocab_size, (4, 9)).astype(np.int32)
    examples = [{"tokens": t, "loss_mask": np.ones_like(t)} for t in tokens]
    for captures in ((1, 3), (3, 0, 2)):
        got = with_hidden(examples, model, params, 2, tmp_path, "tiny", captures, store_layers=(0, 1, 2, 3))
        out = target_forward(model, params, {"tokens": jnp.asarray(tokens)}, captures)
        np.testing.assert_allclose(np.stack([e["captured"] for e in got]), np.asarray(out.captured), atol=2e-3)
        assert [e["captured"].shape for e in got[1:3]] == [(9, len(captures) * DEEP.hidden_size)] * 2
    assert [p.name.split("-", 2)[2] for p in tmp_path.glob("captured-*")] == ["0-1-2-3.npy"]
    plain = with_hidden(examples, model, params, 2, tmp_path, "tiny", (), store_layers=(0, 1, 2, 3))  # no captures
    assert "captured" not in plain[0] and plain[0]["hidden"].shape == (9, DEEP.hidden_size)
    assert "target captured states: read from" in capsys.readouterr().out  # the second method computed nothing
    with pytest.raises(TrainConfigError, match=r"data.store_layers \[0, 1\] lack the method's captured layers \[3\]"):
        with_hidden(examples, model, params, 2, tmp_path, "tiny", (1, 3), store_layers=(0, 1))
    with pytest.raises(TrainConfigError, match=r"data.store_layers \[7\] are not layers of the target"):
        check_store_layers((1, 7), (1,), DEEP.num_layers)
    with pytest.raises(ValueError, match="must be distinct layer ids >= 0"):
        DataConfig(kind="sharegpt", train="x", store_layers=(1, 1))


def test_topk_kl_is_the_kl_over_the_top_k_and_the_rest():
    rng = np.random.default_rng(1)
    v, k = 11, 4
    target, draft = rng.normal(size=(2, 3, v)) * 2, rng.normal(size=(2, 3, v))
    p, q = np.exp(_log_softmax(target)), np.exp(_log_softmax(draft))
    ids = np.argsort(-p, axis=-1)[..., :k]
    p_top, q_top = np.take_along_axis(p, ids, -1), np.take_along_axis(q, ids, -1)
    p_rest, q_rest = 1 - p_top.sum(-1), 1 - q_top.sum(-1)
    want = (p_top * np.log(p_top / q_top)).sum(-1) + p_rest * np.log(p_rest / q_rest)
    mask = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    got = topk_kl(jnp.asarray(draft, jnp.float32), jnp.asarray(ids, jnp.int32),
                  jnp.asarray(np.log(p_top), jnp.float32), jnp.asarray(mask, jnp.float32))
    np.testing.assert_allclose(float(got), (want * mask).sum() / mask.sum(), rtol=1e-5)
    grad = jax.grad(lambda x: topk_kl(x, jnp.asarray(ids), jnp.asarray(np.log(p_top), jnp.float32),
                                      jnp.asarray(mask, jnp.float32)))(jnp.asarray(draft, jnp.float32))
    assert np.isfinite(np.asarray(grad)).all() and np.abs(np.asarray(grad)).sum() > 0
    # the draft equal to the target on those k + 1 outcomes: zero
    same = topk_kl(jnp.asarray(target, jnp.float32), jnp.asarray(ids), jnp.asarray(np.log(p_top), jnp.float32),
                   jnp.ones((2, 3)))
    assert abs(float(same)) < 1e-5


def test_topk_kl_keeps_the_draft_vocabulary():
    """A top-k id outside the draft vocabulary is dropped and the target renormalised over the rest: equal to the
    KL computed directly on that renormalised distribution."""
    rng = np.random.default_rng(2)
    v, draft_vocab = 9, (0, 2, 3, 5, 8)
    target = rng.normal(size=(1, 1, v)) * 2
    logp = _log_softmax(target)[0, 0]
    ids = np.argsort(-logp)[:3]
    draft = rng.normal(size=(1, 1, len(draft_vocab)))
    q = np.exp(_log_softmax(draft))[0, 0]
    keep = [i for i in ids if i in draft_vocab]
    p_keep = np.exp(logp[keep])
    p_rest = 1 - np.exp(logp[ids]).sum()
    norm = p_keep.sum() + p_rest
    q_keep = q[[draft_vocab.index(i) for i in keep]]
    want = ((p_keep / norm) * np.log(p_keep / norm / q_keep)).sum() + (p_rest / norm) * np.log(
        (p_rest / norm) / (1 - q_keep.sum()))
    got = topk_kl(jnp.asarray(draft, jnp.float32), jnp.asarray(ids[None, None], jnp.int32),
                  jnp.asarray(logp[ids][None, None], jnp.float32), jnp.ones((1, 1)), draft_vocab)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


@pytest.fixture(scope="module")
def target_batch():
    params = init_params(CONFIG, jax.random.key(3))
    model = Transformer(CONFIG)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, 10)), jnp.int32)
    batch = {"tokens": tokens, "loss_mask": jnp.ones((2, 10), jnp.int32)}
    return model, params, batch, target_forward(model, params, batch)


def test_target_labels_are_the_targets_greedy_tokens(target_batch, tmp_path):
    model, params, batch, out = target_batch
    data = with_target_labels(batch, out, LossConfig())
    assert "labels" not in data and "greedy" in data  # agreement with the target is measured whatever is learnt
    hard = with_target_labels(batch, out, LossConfig(labels="target"))
    best = np.argmax(np.asarray(out.logits), -1)
    np.testing.assert_array_equal(np.asarray(hard["labels"])[:, 1:], best[:, :-1])
    np.testing.assert_array_equal(np.asarray(hard["labels"])[:, 0], np.asarray(batch["tokens"])[:, 0])
    assert "label_logits" not in hard
    kl = with_target_labels(batch, out, LossConfig(labels="target", kind="kl"))
    assert kl["label_logits"] is out.logits
    # from the label store: its top-1, and its top-k for the KL
    examples = [{"tokens": np.asarray(t), "loss_mask": np.ones(10, np.int32)} for t in batch["tokens"]]
    stored = with_hidden(examples, model, params, 2, tmp_path, "tiny", label_top_k=4)
    store = batch | {k: jnp.stack([jnp.asarray(e[k]) for e in stored]) for k in ("label_ids", "label_logp")}
    from_store = with_target_labels(store, None, LossConfig(labels="target", kind="kl"))
    np.testing.assert_array_equal(np.asarray(from_store["labels"]), np.asarray(hard["labels"]))
    assert "label_logp" in from_store and "label_logits" not in from_store
    assert "label_logp" not in with_target_labels(store, None, LossConfig(labels="target"))


def test_medusa_learns_what_loss_asks_for(target_batch):
    """The LM term of head k at t: CE on the data's token, CE on the target's greedy token, or the KL to the
    target's whole distribution at t + 1 + k (equal to a direct computation)."""
    _, _, batch, out = target_batch
    logits = jax.random.normal(jax.random.key(4), (2, 10, 2, CONFIG.vocab_size))
    losses = {}
    for loss in (LossConfig(), LossConfig(labels="target"), LossConfig(labels="target", kind="kl")):
        losses[(loss.labels, loss.kind)], metrics = head_losses(logits, with_target_labels(batch, out, loss),
                                                                [1.0, 0.0])
    assert len({float(v) for v in losses.values()}) == 3
    p = jax.nn.log_softmax(out.logits[:, 1:9], -1)  # head 0 at t drafts what the target predicts at t + 1
    q = jax.nn.log_softmax(logits[:, :8, 0], -1)
    want = float((jnp.exp(p) * (p - q)).sum(-1).mean())
    np.testing.assert_allclose(float(losses[("target", "kl")]), want, rtol=1e-5)
    labelled = with_target_labels(batch, out, LossConfig(labels="target", kind="kl"))
    np.testing.assert_allclose(float(target_kl(logits[:, :8, 0], labelled, 1, jnp.ones((2, 8)))), want, rtol=1e-5)


def test_train_on_the_targets_labels_from_the_label_store(smoke_model, tmp_path):
    """`loss.labels: target`, `kind: kl` through the CLI: the label store is written beside the hidden states,
    read back by a second run, and the heads report their agreement with the target."""
    from amphista_jax.cli import main
    from tests.helpers import write_code_files

    run_dir, _ = smoke_model
    args = ["train", "--config", "configs/medusa/code.yaml", "--set", f"model={run_dir / 'export'}",
            "--set", "data.kind=text", "--set", f"data.train={write_code_files(tmp_path / 'code')}",
            "--set", "data.max_len=32", "--set", "data.batch_size=4", "--set", "loop.steps=2",
            "--set", "loop.eval_every=2", "--set", "drafter.num_heads=2",
            "--set", "data.cache_target_hidden=true", "--set", f"data.hidden_store={tmp_path / 'store'}",
            "--set", "loss.labels=target", "--set", "loss.kind=kl", "--set", "loss.top_k=8"]
    assert main(args + ["--set", f"out_dir={tmp_path / 'a'}"]) == 0
    names = sorted(p.name.split("-")[0] for p in (tmp_path / "store").iterdir())
    assert names == ["hidden"] * 2 + ["label_ids"] * 2 + ["label_logp"] * 2  # train and held-out
    assert main(args + ["--set", f"out_dir={tmp_path / 'b'}"]) == 0
    a, b = (json.loads((tmp_path / r / "summary.json").read_text())["heldout_after"] for r in "ab")
    assert a == b and {"head0/kl", "head0/agree", "head1/agree"} <= set(a)


LABEL_CASES = [(name, {}) for name in sorted(DRAFTERS) if DRAFTERS[name].trainable
               and not DRAFTERS[name].loss_runs_target] + [
    ("hydra", {"lm_weight": 0.0, "teacher_weight": 1.0}), ("eagle3", {"lm_weight": 1.0, "teacher_weight": 0.0}),
    ("amphista", {"lambda_lm": 0.0})]


@pytest.mark.parametrize("name, settings", LABEL_CASES, ids=[f"{n}{'-' + '-'.join(s) if s else ''}"
                                                             for n, s in LABEL_CASES])
def test_a_loss_reads_the_labels_exactly_when_it_says_so(name, settings):
    """`reads_labels`, which the config check trusts, is what the loss does: other labels change the loss
    exactly when the drafter says it has an LM term on them."""
    drafter = DRAFTERS[name].from_settings(settings)
    model, params = Transformer(DEEP), init_params(DEEP, jax.random.key(5))
    target = Target(DEEP, params)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, DEEP.vocab_size, (2, 12)), jnp.int32)
    batch = {"tokens": tokens, "loss_mask": jnp.ones((2, 12), jnp.int32), "rng": jax.random.key(6)}
    out = target_forward(model, params, batch, drafter.captured_layers(DEEP))
    heads = drafter.init(jax.random.key(7), target)
    losses = {float(drafter.loss(heads, target, batch | {"labels": labels}, out)[0])
              for labels in (tokens, jnp.asarray(rng.integers(0, DEEP.vocab_size, (2, 12)), jnp.int32))}
    assert (len(losses) == 2) == drafter.reads_labels, losses


@default_cases("eagle3")
@pytest.mark.parametrize("name, settings", [("eagle3", {}), ("hydra", {"teacher_weight": 1.0}),
                                            ("amphista", {})], ids=["eagle3", "hydra", "amphista"])
def test_with_a_label_store_the_step_computes_the_draft_vocabularys_logits_alone(name, settings):
    """Where the store gives the greedy labels, the step projects the stored states on the draft vocabulary's columns
    only: its loss and metrics equal the loss over the target's whole logits. (Hydra's and Amphista's teacher terms
    read them through the same `head_losses` as EAGLE-3's: slow.)"""
    from amphista_jax.drafters.draft_vocab import most_frequent
    from amphista_jax.train.step import make_steps

    rng = np.random.default_rng(8)
    tokens = jnp.asarray(rng.integers(0, DEEP.vocab_size, (2, 12)), jnp.int32)
    vocab = most_frequent(np.bincount(np.asarray(tokens).ravel(), minlength=DEEP.vocab_size), 48)
    drafter = DRAFTERS[name].from_settings(settings | {"draft_vocab": vocab})
    model, params = Transformer(DEEP), init_params(DEEP, jax.random.key(5))
    captures = drafter.captured_layers(DEEP)
    full = target_forward(model, params, {"tokens": tokens}, captures)
    logp, ids = jax.lax.top_k(jax.nn.log_softmax(full.logits, -1), 4)
    batch = {"tokens": tokens, "loss_mask": jnp.ones((2, 12), jnp.int32), "hidden": full.hidden,
             "label_ids": ids, "label_logp": logp} | ({"captured": full.captured} if captures else {})
    assert target_forward(model, params, batch, captures, drafter.draft_vocab).logits.shape[-1] == 48
    heads = drafter.init(jax.random.key(7), Target(DEEP, params))
    loss = LossConfig(labels="target", kind="kl", top_k=4)
    _, evaluate = make_steps(model, drafter, optax.sgd(0.0), loss=loss)
    got = evaluate(heads, params, batch)
    want_loss, want = drafter.loss(heads, Target(DEEP, params), with_target_labels(batch, full, loss) | {"rng": None},
                                   full)
    np.testing.assert_allclose(float(got["loss"]), float(want_loss), rtol=1e-5)
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), float(value), rtol=1e-4, atol=1e-6, err_msg=key)


def test_head_losses_gradient_is_each_heads_own(target_batch):
    """`head_losses` takes each head's logits out of `[B, T, K, V]` by one split (`losses.unstack`, whose gradient is
    one concatenation): its loss and gradient equal the sum of each head's own loss computed on `logits[:, :, k]`
    alone, with distinct weights per head, so a head taken in another order or slot would show."""
    _, _, batch, out = target_batch
    labelled = with_target_labels(batch, out, LossConfig(labels="target", kind="kl"))
    logits = jax.random.normal(jax.random.key(5), (2, 10, 3, CONFIG.vocab_size))
    weights = [1.0, 0.5, 0.25]

    def together(x: jax.Array) -> jax.Array:
        return head_losses(x, labelled, weights)[0]

    def head_by_head(x: jax.Array) -> jax.Array:
        t = x.shape[1]
        return sum(w * target_kl(x[:, : t - k - 2, k], labelled, k + 1, jnp.ones((2, t - k - 2)))
                   for k, w in enumerate(weights))

    loss, grad = jax.value_and_grad(together)(logits)
    want, want_grad = jax.value_and_grad(head_by_head)(logits)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(want_grad), rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(grad[:, :, 2]).sum()) > 0  # every head's slot gets its own gradient
