"""Heads in the reference projects' layouts, checked against those projects' own model code (`tests/reference_code.py`):
ours exported (`convert --heads-to`) and loaded by the reference class give our logits; the reference class's own
random init, saved by its own code and imported by us (`convert --heads-from`), gives its logits; what a layout
cannot hold is refused in one line with nothing written. fp32 throughout; logits agree to 1e-4 (at magnitudes ~1-10,
a float32 sum-order difference), at every position."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from amphista_jax.assets import default_model_dir
from amphista_jax.cli import main
from amphista_jax.drafters import DFlash, Eagle, Eagle3, Hydra, Medusa
from amphista_jax.drafters.io import load_draft, save_draft
from amphista_jax.drafters.published import PublishedHeadsError, read_eagle, read_medusa
from amphista_jax.infra.errors import BAD_INPUT_EXIT
from amphista_jax.models.hf import load_params, save_params
from amphista_jax.models.llama import Transformer, init_params
from amphista_jax.models.target import Target
from tests import reference_code

TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def target():
    params, config = load_params(default_model_dir(), dtype="float32")
    return Target(config, params)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """(a 9-layer random target of the embedded one's shape, its directory): speculators refuses a feature layer named
    twice, and EAGLE-3's reference layers 2, L // 2, L - 3 are distinct from 9 layers on, not at the embedded 6."""
    c = dataclasses.replace(load_params(default_model_dir(), dtype="float32")[1], num_layers=9,
                            sliding_windows=(0,) * 9)
    model_dir = tmp_path_factory.mktemp("deep")
    save_params(init_params(c, jax.random.key(3)), c, model_dir, dtype="float32")
    params, c = load_params(model_dir, dtype="float32")
    return Target(c, params), model_dir


def _random_heads(drafter, target, keep=()):
    """`drafter`'s params, every floating leaf but `keep` moved off its init (zeros, copies of the target's)."""
    params = drafter.init(jax.random.key(0), target)
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    moved = [x if any(k in jax.tree_util.keystr(path) for k in keep) else
             x + 0.05 * jax.random.normal(key, x.shape, x.dtype) for (path, x), key in zip(leaves, keys, strict=True)]
    return jax.tree_util.tree_unflatten(tree, moved)


def _export(tmp_path, fmt, drafter, params, target, capsys, model=None, extra=()):
    heads, out = tmp_path / "heads", tmp_path / fmt
    save_draft(heads, drafter.name, drafter, params, target.config, target_params=target.params)
    assert main(["convert", "--heads", str(heads), "--heads-to", fmt, "--model", str(model or default_model_dir()),
                 "--out", str(out), "--dtype", "float32", *extra]) == 0, capsys.readouterr().err
    assert f"in {fmt}'s layout" in capsys.readouterr().out
    return out


def _hidden(target, ids):
    """The target's final-normed hidden states `[1, T, D]` of `ids`."""
    out = Transformer(target.config).apply({"params": target.params}, jnp.asarray(ids)[None],
                                           jnp.arange(len(ids))[None])
    return np.asarray(out.hidden)


def _torch_target():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()


IDS = np.random.default_rng(5).integers(0, 256, 12)
DRAFT_VOCAB = tuple(range(0, 512, 3))  # a draft vocabulary: columns of the target's lm_head


# --- Medusa (medusa-llm 0.1) ---------------------------------------------------------------------------------------
def test_medusa_heads_exported_load_in_medusa_llm_with_our_logits(tmp_path, capsys, target):
    """Ours -> `medusa_lm_head.pt` -> medusa-llm's `MedusaModel` (its own base forward of the target): logits of every
    head at every position equal ours on our target's hidden states."""
    mm = reference_code.medusa_model()
    drafter = Medusa(num_heads=3, num_layers=1)
    params = _random_heads(drafter, target)
    out = _export(tmp_path, "medusa", drafter, params, target, capsys)
    config = mm.MedusaConfig.from_pretrained(out)
    model = mm.MedusaModel(_torch_target(), config.medusa_num_heads, config.medusa_num_layers, str(out))
    state = torch.load(out / "medusa_lm_head.pt")
    model.medusa_head.load_state_dict(state, strict=True)  # the reference loads strict=False: every name must match
    theirs = model(input_ids=torch.as_tensor(IDS)[None]).detach().numpy()[:, 0]  # [K, T, V]
    ours = np.asarray(drafter.head_logits(params, target, jnp.asarray(_hidden(target, IDS))))[0]  # [T, K, V]
    np.testing.assert_allclose(ours.transpose(1, 0, 2), theirs, **TOL)


def test_medusa_heads_with_a_draft_vocabulary_widened_load_in_medusa_llm_with_our_logits(tmp_path, capsys, target):
    """`--whole-vocab`: heads that read the target's shared lm_head at draft-vocabulary columns are written drafting
    over every column; medusa-llm's logits equal ours widened, and at the draft columns the heads' own."""
    mm = reference_code.medusa_model()
    drafter = Medusa(num_heads=2, num_layers=1, shared_lm_head=True, draft_vocab=DRAFT_VOCAB)
    params = _random_heads(drafter, target)
    out = _export(tmp_path, "medusa", drafter, params, target, capsys, extra=("--whole-vocab",))
    model = mm.MedusaModel(_torch_target(), 2, 1, str(out))
    model.medusa_head.load_state_dict(torch.load(out / "medusa_lm_head.pt"), strict=True)
    theirs = model(input_ids=torch.as_tensor(IDS)[None]).detach().numpy()[:, 0].transpose(1, 0, 2)  # [T, K, V]
    hidden = jnp.asarray(_hidden(target, IDS))
    widened = dataclasses.replace(drafter, draft_vocab=())
    np.testing.assert_allclose(np.asarray(widened.head_logits(params, target, hidden))[0], theirs, **TOL)
    np.testing.assert_allclose(np.asarray(drafter.head_logits(params, target, hidden))[0],
                               theirs[..., list(DRAFT_VOCAB)], **TOL)


def test_medusa_llm_heads_saved_by_its_code_import_with_its_logits(tmp_path, capsys, target):
    """medusa-llm's own init (randomised), saved as its trainer saves it, read by `--heads-from medusa`; a key it
    would silently ignore (it loads with strict=False) is refused by us."""
    mm = reference_code.medusa_model()
    torch.manual_seed(0)
    model = mm.MedusaModel(_torch_target(), 2, 1, "target")
    with torch.no_grad():
        for p in model.medusa_head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    src = tmp_path / "released"
    mm.MedusaConfig(medusa_num_heads=2, medusa_num_layers=1, base_model_name_or_path="target").save_pretrained(src)
    torch.save(model.medusa_head.state_dict(), src / "medusa_lm_head.pt")
    drafter, params = read_medusa(src, target)
    theirs = model(input_ids=torch.as_tensor(IDS)[None]).detach().numpy()[:, 0]
    ours = np.asarray(drafter.head_logits(params, target, jnp.asarray(_hidden(target, IDS))))[0]
    np.testing.assert_allclose(ours.transpose(1, 0, 2), theirs, **TOL)
    torch.save(model.medusa_head.state_dict() | {"0.2.weight": torch.zeros(3)}, src / "medusa_lm_head.pt")
    with pytest.raises(PublishedHeadsError, match=r"0\.2\.weight.*not Medusa's"):
        read_medusa(src, target)


# --- EAGLE-1 (eagle-llm 1.2.1) ---------------------------------------------------------------------------------------
def _eagle_reference(cnets, path):
    """eagle-llm's draft loaded as `EaModel` loads it: its config, `bias` from the raw JSON, a strict state dict."""
    config = cnets.EConfig.from_pretrained(path)
    model = cnets.Model(config, bias=json.loads((path / "config.json").read_text()).get("bias", True)).eval()
    model.load_state_dict(torch.load(path / "pytorch_model.bin"), strict=True)
    return model


def _eagle_logits(model, hidden, ids, lm_head):
    """eagle-llm's draft logits: position t reads (h_t, token t + 1), positions from 0, the target's lm_head."""
    with torch.no_grad():
        out = model(torch.as_tensor(hidden[:, :-1]), torch.as_tensor(ids[None, 1:]))
    return out.numpy()[0] @ np.asarray(lm_head)


def test_eagle_heads_exported_load_in_eagle_llm_with_our_logits(tmp_path, capsys, target):
    cnets = reference_code.eagle_cnets()
    drafter = Eagle(input_norm=False, rope_theta=10000.0)
    params = _random_heads(drafter, target)
    out = _export(tmp_path, "eagle", drafter, params, target, capsys)
    hidden = _hidden(target, IDS)
    theirs = _eagle_logits(_eagle_reference(cnets, out), hidden, IDS, target.lm_head())
    ours = np.asarray(drafter.draft_logits(params, target, jnp.asarray(IDS)[None], jnp.asarray(hidden))[0])[0, :-1, 0]
    np.testing.assert_allclose(ours, theirs, **TOL)


def test_eagle_llm_heads_import_with_their_rope_base_not_the_targets(tmp_path, target):
    """eagle-llm's own `cnets.Model` (randomised), saved by its code, read for a target whose RoPE base is 100000
    (SmolLM2's): the draft layer keeps the reference's 10000, and every position's logits equal its."""
    cnets = reference_code.eagle_cnets()
    c = target.config
    far = Target(dataclasses.replace(c, rope_theta=100000.0), target.params)
    torch.manual_seed(0)
    config = cnets.EConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_hidden_layers=1, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                           rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_positions)
    model = cnets.Model(config, bias=True).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        model.embed_tokens.weight.copy_(torch.as_tensor(np.asarray(far.embed(jnp.arange(c.vocab_size)))))  # as shipped
    src = tmp_path / "released"
    config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    drafter, params = read_eagle(src, far)
    assert drafter.rope_theta == 10000.0
    hidden = np.random.default_rng(2).standard_normal((1, len(IDS), c.hidden_size)).astype(np.float32)
    theirs = _eagle_logits(model, hidden, IDS, far.lm_head())
    ours = np.asarray(drafter.draft_logits(params, far, jnp.asarray(IDS)[None], jnp.asarray(hidden))[0])[0, :-1, 0]
    np.testing.assert_allclose(ours, theirs, **TOL)
    wrong = dataclasses.replace(drafter, rope_theta=0.0)  # the target's base, as before the fix: off past position 0
    off = np.asarray(wrong.draft_logits(params, far, jnp.asarray(IDS)[None], jnp.asarray(hidden))[0])[0, :-1, 0]
    assert np.abs(off[0] - theirs[0]).max() < 1e-4 < np.abs(off[1:] - theirs[1:]).max()


# --- DFlash (z-lab's dflash 0.1.0) -------------------------------------------------------------------------------
def _dflash_logits(model, target, ids, captured, anchor, block_size, mask_token_id):
    """z-lab's draft of the block `[ids[anchor], MASK x (B - 1)]` after the context features of positions
    `< anchor`, as its `spec_generate` runs it: slots 1 .. B - 1's logits through the target's lm_head."""
    block = np.asarray([ids[anchor]] + [mask_token_id] * (block_size - 1))
    noise = torch.as_tensor(np.asarray(target.embed(jnp.asarray(block))))[None]
    with torch.no_grad():
        out = model(position_ids=torch.arange(anchor + block_size)[None], noise_embedding=noise,
                    target_hidden=torch.as_tensor(captured[:, :anchor]))
    return out.numpy()[0, 1:] @ np.asarray(target.lm_head())


def _ours_dflash(drafter, params, target, ids, captured, anchor):
    return np.asarray(drafter.draft_logits(params, target, jnp.asarray(ids)[None], jnp.asarray(captured),
                                           jnp.asarray([[anchor]]), jnp.asarray([[True]])))[0, 0]


def test_dflash_heads_exported_load_in_dflash_with_our_logits(tmp_path, capsys, target):
    dm = reference_code.dflash_model()
    drafter = DFlash(num_layers=2, block_size=4, mask_token_id=7)
    params = _random_heads(drafter, target, keep=("mask_embedding",))  # MASK stays the target's token 7
    out = _export(tmp_path, "dflash", drafter, params, target, capsys)
    model = dm.DFlashDraftModel.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    width = len(drafter.layer_ids(target.config)) * target.config.hidden_size
    captured = np.random.default_rng(4).standard_normal((1, len(IDS), width)).astype(np.float32)
    for anchor in (1, 7):
        np.testing.assert_allclose(_ours_dflash(drafter, params, target, IDS, captured, anchor),
                                   _dflash_logits(model, target, IDS, captured, anchor, 4, 7), **TOL)


def test_dflash_with_its_mask_the_targets_token_widened_loads_in_dflash_with_our_logits(tmp_path, capsys, target):
    """`learned_mask=False` (MASK is the target's token, no parameter: the reference's form) and a draft vocabulary
    read at every column with `--whole-vocab`: z-lab's logits equal ours."""
    dm = reference_code.dflash_model()
    drafter = DFlash(num_layers=1, block_size=4, mask_token_id=7, learned_mask=False, draft_vocab=DRAFT_VOCAB)
    params = _random_heads(drafter, target)
    assert "mask_embedding" not in params
    out = _export(tmp_path, "dflash", drafter, params, target, capsys, extra=("--whole-vocab",))
    model = dm.DFlashDraftModel.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    width = len(drafter.layer_ids(target.config)) * target.config.hidden_size
    captured = np.random.default_rng(6).standard_normal((1, len(IDS), width)).astype(np.float32)
    widened = dataclasses.replace(drafter, draft_vocab=())
    np.testing.assert_allclose(_ours_dflash(widened, params, target, IDS, captured, 5),
                               _dflash_logits(model, target, IDS, captured, 5, 4, 7), **TOL)
    with pytest.raises(ValueError, match="mask_token_id >= 0"):
        DFlash(learned_mask=False)


def test_dflash_drafters_saved_by_its_code_import_with_its_logits(tmp_path, capsys, target):
    dm = reference_code.dflash_model()
    from transformers import Qwen3Config

    c = target.config
    config = Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=2, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                         head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_positions,
                         rope_theta=c.rope_theta, attention_bias=False)
    config.num_target_layers = c.num_layers
    config.dflash_config = {"block_size": 4, "mask_token_id": 9, "target_layer_ids": [1, 3]}
    config.block_size = 4
    torch.manual_seed(0)
    model = dm.DFlashDraftModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "released")
    out = tmp_path / "ours"
    assert main(["convert", "--heads-from", "dflash", str(tmp_path / "released"), "--model", str(default_model_dir()),
                 "--out", str(out), "--dtype", "float32"]) == 0, capsys.readouterr().err
    _, drafter, params = load_draft(out, target.config, target.params)
    assert (drafter.block_size, drafter.mask_token_id, drafter.layer_ids(c)) == (4, 9, (1, 3))
    captured = np.random.default_rng(4).standard_normal((1, len(IDS), 2 * c.hidden_size)).astype(np.float32)
    np.testing.assert_allclose(_ours_dflash(drafter, params, target, IDS, captured, 5),
                               _dflash_logits(model.eval(), target, IDS, captured, 5, 4, 9), **TOL)


# --- EAGLE-3 (SafeAILab's layout, read by speculators 0.9.0's converter and draft model; speculators' own) -----------
def _speculators_eagle3_logits(model, captured, ids):
    """speculators' step-0 draft logits `[T - 1, V_d]` (caught at its lm_head: its forward returns token ids):
    position t reads (token t + 1, features t)."""
    logits = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: logits.append(output.detach()))
    with torch.no_grad():
        model(hidden_states=torch.as_tensor(captured[:, :-1]), input_ids=torch.as_tensor(ids[None, 1:]),
              document_ids=torch.zeros(1, len(ids) - 1, dtype=torch.long), ttt_steps=1)
    hook.remove()
    return logits[0].numpy()[0]


@pytest.mark.parametrize("vocab", [1000, 0], ids=["draft-vocab", "whole-vocab"])
def test_eagle3_heads_exported_in_speculators_layout_load_with_our_logits(tmp_path, capsys, deep, vocab):
    """Ours -> `--heads-to eagle3-speculators` -> speculators' `Eagle3DraftModel.from_pretrained`, the target as
    verifier: equal logits; and back with `--heads-from eagle3`, the same drafter and params."""
    deep, model_dir = deep
    c = deep.config
    ids = tuple(sorted(np.random.default_rng(6).choice(c.vocab_size, vocab, replace=False).tolist())) if vocab else ()
    drafter = Eagle3(draft_vocab=ids, feature_layers=(1, 4, 8))
    params = _random_heads(drafter, deep)
    out = _export(tmp_path, "eagle3-speculators", drafter, params, deep, capsys, model_dir)
    model = reference_code.eagle3_from_pretrained(out)
    assert model.config.eagle_aux_hidden_state_layer_ids == [1, 4, 8]
    captured = np.random.default_rng(4).standard_normal((1, len(IDS), 3 * c.hidden_size)).astype(np.float32)
    ours = np.asarray(drafter.draft_logits(params, deep, jnp.asarray(IDS)[None], jnp.asarray(captured)))
    np.testing.assert_allclose(ours[0, :-1, 0], _speculators_eagle3_logits(model, captured, IDS), **TOL)
    back = tmp_path / "back"
    assert main(["convert", "--heads-from", "eagle3", str(out), "--model", str(model_dir), "--out", str(back),
                 "--dtype", "float32"]) == 0, capsys.readouterr().err
    _, again, again_params = load_draft(back, c, deep.params)
    assert again == dataclasses.replace(drafter, rope_theta=c.rope_theta)  # the base named where it was implied
    jax.tree.map(np.testing.assert_array_equal, again_params, params)


def test_speculators_dflash_exported_and_its_own_imported_give_its_logits(tmp_path, capsys, target):
    """Ours -> `--heads-to dflash-speculators` -> speculators' `DFlashDraftModel` (its modules run as vLLM runs them:
    the block after the context, slots 1 .. B - 1 through its lm_head) equals ours; speculators' own saved
    checkpoint read back by `--heads-from dflash` gives the same drafter."""
    spec = reference_code.speculators()
    drafter = DFlash(num_layers=2, block_size=4, mask_token_id=7)
    params = _random_heads(drafter, target, keep=("mask_embedding",))
    out = _export(tmp_path, "dflash-speculators", drafter, params, target, capsys)
    model = spec.DFlashDraftModel.from_pretrained(out, attn_implementation="eager").eval()
    width = len(drafter.layer_ids(target.config)) * target.config.hidden_size
    captured = np.random.default_rng(4).standard_normal((1, len(IDS), width)).astype(np.float32)
    anchor, block = 6, torch.as_tensor([[int(IDS[6]), 7, 7, 7]])
    with torch.no_grad():
        x = model.embed_tokens(block)
        context = model.hidden_norm(model.fc(torch.as_tensor(captured[:, :anchor])))
        positions = torch.arange(anchor + 4)[None]
        rotary = model.rotary_emb(x, positions)
        for layer in model.layers:
            x = layer(hidden_states=x, target_hidden=context, attention_mask=None, position_ids=positions,
                      position_embeddings=rotary)
        theirs = model.lm_head(model.norm(x)).numpy()[0, 1:]
    np.testing.assert_allclose(_ours_dflash(drafter, params, target, IDS, captured, anchor), theirs, **TOL)
    model.save_pretrained(tmp_path / "saved")  # speculators' own save of what it loaded
    back = tmp_path / "back"
    assert main(["convert", "--heads-from", "dflash", str(tmp_path / "saved"), "--model", str(default_model_dir()),
                 "--out", str(back), "--dtype", "float32"]) == 0, capsys.readouterr().err
    _, again, again_params = load_draft(back, target.config, target.params)
    assert (again.block_size, again.mask_token_id, again.layer_ids(target.config)) == (
        4, 7, drafter.layer_ids(target.config))
    np.testing.assert_allclose(_ours_dflash(again, again_params, target, IDS, captured, anchor), theirs, **TOL)

def test_eagle3_heads_exported_convert_and_load_in_speculators_with_our_logits(tmp_path, capsys, deep):
    """Ours -> SafeAILab's layout -> speculators' own `Eagle3Converter` (the path released EAGLE-3 heads take into
    vLLM) -> its `Eagle3DraftModel` with our target as verifier: step 0's draft logits at every position equal ours,
    over a draft vocabulary (`d2t` / `t2d`)."""
    reference_code.speculators()
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    deep, model_dir = deep
    c = deep.config
    vocab = tuple(sorted(np.random.default_rng(6).choice(c.vocab_size, 1000, replace=False).tolist()))
    drafter = Eagle3(draft_vocab=vocab)
    params = _random_heads(drafter, deep)
    out = _export(tmp_path, "eagle3", drafter, params, deep, capsys, model_dir)
    Eagle3Converter().convert(out, tmp_path / "speculators", base_model=str(model_dir), validate=False)
    model = reference_code.eagle3_from_pretrained(tmp_path / "speculators")
    captured = np.random.default_rng(4).standard_normal((1, len(IDS), 3 * c.hidden_size)).astype(np.float32)
    logits = _speculators_eagle3_logits(model, captured, IDS)
    ours = np.asarray(drafter.draft_logits(params, deep, jnp.asarray(IDS)[None], jnp.asarray(captured)))
    np.testing.assert_allclose(ours[0, :-1, 0], logits, **TOL)


# --- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt, drafter, needle", [
    ("medusa", Hydra(num_heads=2), "are not Medusa heads"),
    ("medusa", Medusa(num_heads=2, num_layers=2), "2 distinct ResBlocks per head"),
    ("eagle", Eagle(), "input_norm=True"),
    ("eagle", Eagle(input_norm=False, rope_theta=100000.0), "RoPE base 100000"),
    ("eagle3", Eagle3(feature_layers=(0, 1, 2)), "fuse target layers [0, 1, 2]"),
    ("eagle3-speculators", Eagle3(), "named twice"),
    ("dflash", DFlash(num_layers=1, block_size=4), "MASK embedding"),
    ("eagle", Eagle(input_norm=False, rope_theta=10000.0, draft_vocab=DRAFT_VOCAB), "(--whole-vocab reads"),
    ("medusa", Medusa(num_heads=2, draft_vocab=DRAFT_VOCAB), "score 171 draft tokens; Medusa's heads score the whole "
     "vocabulary; nothing"),  # its own lm_head over the draft vocabulary: --whole-vocab cannot help, so not named
    ("medusa --whole-vocab", Medusa(num_heads=2, draft_vocab=DRAFT_VOCAB), "weights of their own, so --whole-vocab"),
    ("eagle3 --whole-vocab", Eagle3(feature_layers=(0, 2, 3), draft_vocab=DRAFT_VOCAB), "cannot widen them"),
])
def test_what_a_layout_cannot_hold_is_refused_in_one_line(tmp_path, capsys, target, fmt, drafter, needle):
    heads, out, model = tmp_path / "heads", tmp_path / "out", default_model_dir()
    save_draft(heads, drafter.name, drafter, _random_heads(drafter, target), target.config, target_params=target.params)
    code = main(["convert", "--heads", str(heads), "--heads-to", *fmt.split(), "--model", str(model), "--out",
                 str(out)])
    err = capsys.readouterr().err
    assert code == BAD_INPUT_EXIT and needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_export_bad_arguments_are_one_line(tmp_path, capsys, target):
    heads = tmp_path / "heads"
    drafter = Medusa(num_heads=2)
    save_draft(heads, "medusa", drafter, _random_heads(drafter, target), target.config, target_params=target.params)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    model = str(default_model_dir())
    for argv, needle in ((["--heads", str(heads), "--heads-to", "vllm"], "unknown layout"),
                         (["--heads-to", "medusa"], "name them with --heads"),
                         (["--heads", str(heads), "--whole-vocab"], "name the layout"),
                         (["--heads", str(heads), "--heads-to", "medusa", "--out", str(tmp_path / "taken")],
                          "already exists")):
        argv = argv if "--out" in argv else argv + ["--out", str(tmp_path / "new")]
        assert main(["convert", *argv, "--model", model]) == BAD_INPUT_EXIT
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "new").exists() and (tmp_path / "taken" / "mine.txt").read_text() == "keep"
    assert load_draft(heads, target.config, target.params)[0] == "medusa"
