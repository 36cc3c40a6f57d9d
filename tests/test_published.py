"""Heads released in other projects' layouts: torch files read without torch, Medusa's released heads converted
into ours (same logits as the reference's forward, lossless decoding, refused for another target)."""

from __future__ import annotations

import dataclasses
import functools
import json
import pickle
import zipfile

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from amphista_jax import Generator
from amphista_jax.assets import default_model_dir
from amphista_jax.cli import main
from amphista_jax.drafters.base import PrefillContext
from amphista_jax.drafters.io import load_draft
from amphista_jax.drafters.published import PublishedHeadsError, read_eagle, read_eagle3, read_medusa
from amphista_jax.infra.errors import BAD_INPUT_EXIT
from amphista_jax.models.hf import load_params
from amphista_jax.models.llama import Output
from amphista_jax.models.target import Target
from amphista_jax.models.torch_files import TensorFileError, read_safetensors, read_torch_file, write_torch_file
from tests.helpers import default_cases


def test_torch_and_safetensors_files_read_without_torch(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"f32": torch.randn(3, 4, generator=g), "f16": torch.randn(5, generator=g).half(),
             "bf16": torch.randn(2, 3, generator=g).bfloat16(), "i64": torch.arange(6).reshape(2, 3),
             "strided": torch.randn(4, 6, generator=g).t(), "offset": torch.randn(10, generator=g)[3:7],
             "param": torch.nn.Parameter(torch.randn(2, 2, generator=g))}
    torch.save(state, tmp_path / "w.pt")
    got = read_torch_file(tmp_path / "w.pt")
    assert set(got) == set(state)
    for name, t in state.items():
        want = t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()
        assert got[name].shape == tuple(t.shape)
        np.testing.assert_array_equal(np.asarray(got[name], want.dtype), want)
    assert got["bf16"].dtype == ml_dtypes.bfloat16
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in state.items()}, tmp_path / "w.safetensors")
    st = read_safetensors(tmp_path / "w.safetensors")
    for name in state:
        np.testing.assert_array_equal(np.asarray(st[name], np.float64), np.asarray(got[name], np.float64))


def test_torch_files_written_without_torch_load_in_torch(tmp_path):
    """`write_torch_file` writes what `torch.load(weights_only=True)` reads back exactly, every dtype and shape."""
    state = {"w.weight": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32),
             "bf16": np.asarray([1.5, -2.25], ml_dtypes.bfloat16), "d2t": np.asarray([0, -1, 2**40], np.int64),
             "t2d": np.asarray([True, False]), "empty": np.zeros((0, 3), np.float16), "scalar": np.float32(2.0)}
    write_torch_file(tmp_path / "w.pt", state)
    loaded = torch.load(tmp_path / "w.pt", weights_only=True)
    assert list(loaded) == list(state)
    for name, want in state.items():
        got = loaded[name]
        assert tuple(got.shape) == np.shape(want) and got.is_contiguous()
        np.testing.assert_array_equal(got.float().numpy() if got.dtype == torch.bfloat16 else got.numpy(),
                                      np.asarray(want, np.float32) if name == "bf16" else want)
    assert {k: v.dtype for k, v in read_torch_file(tmp_path / "w.pt").items()} == {
        k: np.asarray(v).dtype for k, v in state.items()}


def test_a_torch_file_cannot_run_code(tmp_path):
    class Evil:
        def __reduce__(self):
            import os

            return os.system, ("echo pwned",)

    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("evil/data.pkl", pickle.dumps({"x": Evil()}))
    with pytest.raises(TensorFileError, match="posix.system|os.system"):
        read_torch_file(path)
    (tmp_path / "old.pt").write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(TensorFileError, match="not a zip-format"):
        read_torch_file(tmp_path / "old.pt")


def _released_medusa(path, d: int, v: int, heads: int = 3, layers: int = 1, seed: int = 0) -> torch.nn.ModuleList:
    """Medusa's released form: head i = Sequential(ResBlock x layers, Linear(D, V, bias=False)), saved as
    FasterDecoding saves it (the ModuleList's state dict in medusa_lm_head.pt, config.json beside it)."""

    class ResBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(d, d)

        def forward(self, x):
            return x + torch.nn.functional.silu(self.linear(x))

    torch.manual_seed(seed)
    heads_ = torch.nn.ModuleList([torch.nn.Sequential(*[ResBlock() for _ in range(layers)],
                                                      torch.nn.Linear(d, v, bias=False)) for _ in range(heads)])
    path.mkdir(parents=True)
    torch.save(heads_.state_dict(), path / "medusa_lm_head.pt")
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                  "base_model_name_or_path": "some/model"}))
    return heads_


@pytest.mark.parametrize("layers", [1, 2])
@default_cases("1")
def test_released_medusa_heads_give_the_references_logits_and_decode_losslessly(tmp_path, capsys, layers):
    """Under -m slow for two ResBlocks per head ([2]): [1] runs the same per-layer conversion, compared with the
    reference's logits and decoded losslessly."""
    model = default_model_dir()
    params, config = load_params(model, dtype="float32")
    reference = _released_medusa(tmp_path / "released", config.hidden_size, config.vocab_size, layers=layers)
    out = tmp_path / "heads"
    assert main(["convert", "--heads-from", "medusa", str(tmp_path / "released"), "--model", str(model),
                 "--out", str(out), "--dtype", "checkpoint"]) == 0
    assert "as medusa heads" in capsys.readouterr().out
    method, drafter, heads = load_draft(out, config, params)
    assert (method, drafter.num_heads, drafter.num_layers, drafter.shared_lm_head) == ("medusa", 3, layers, False)
    hidden = np.random.default_rng(0).standard_normal((2, 5, config.hidden_size)).astype(np.float32)
    ours = drafter.head_logits(heads, Target(config, params), jnp.asarray(hidden))  # [B, T, K, V]
    with torch.no_grad():
        theirs = torch.stack([h(torch.from_numpy(hidden)) for h in reference], dim=2).numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-4)
    gen = Generator.load(model, out, "small-8")
    prompts = ["def add(a, b):", "import os\n"]
    assert gen.generate(prompts, max_new_tokens=16).token_ids == gen.autoregressive().generate(
        prompts, max_new_tokens=16).token_ids


def test_released_heads_for_another_target_are_refused_in_one_line(tmp_path, capsys):
    model = default_model_dir()
    params, config = load_params(model, dtype="float32")
    _released_medusa(tmp_path / "wide", config.hidden_size + 8, config.vocab_size)
    with pytest.raises(PublishedHeadsError, match="trained for another model"):
        read_medusa(tmp_path / "wide", Target(config, params))
    code = main(["convert", "--heads-from", "medusa", str(tmp_path / "wide"), "--model", str(model), "--out",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == BAD_INPUT_EXIT and len(err.strip().splitlines()) == 1 and "0.0.linear.weight" in err
    assert not (tmp_path / "out" / "draft.json").exists()
    for argv, needle in ((["--heads-from", "hydra", str(tmp_path)], "unknown layout"),
                         (["--heads-from", "medusa", str(tmp_path / "nothing")], "holds none of")):
        (tmp_path / "nothing").mkdir(exist_ok=True)
        assert main(["convert", *argv, "--model", str(model), "--out", str(tmp_path / "o2")]) == BAD_INPUT_EXIT
        assert needle in capsys.readouterr().err


class _RefLayer(torch.nn.Module):
    """A Llama decoder layer as SafeAILab's EAGLE code defines it (HF names): attention reads `d_in`-wide inputs
    (EAGLE-3: `[input_layernorm(E) ; hidden_norm(h)]`); EAGLE-1's layer 0 has no input norm."""

    def __init__(self, c, d_in: int, input_norm: bool, fused: bool):
        super().__init__()
        lin = functools.partial(torch.nn.Linear, bias=False)
        self.c, self.fused, self.has_input_norm = c, fused, input_norm
        self.self_attn = torch.nn.Module()
        self.self_attn.q_proj = lin(d_in, c.num_heads * c.head_dim)
        self.self_attn.k_proj = lin(d_in, c.num_kv_heads * c.head_dim)
        self.self_attn.v_proj = lin(d_in, c.num_kv_heads * c.head_dim)
        self.self_attn.o_proj = lin(c.num_heads * c.head_dim, c.hidden_size)
        self.mlp = torch.nn.Module()
        self.mlp.gate_proj = lin(c.hidden_size, c.intermediate_size)
        self.mlp.up_proj = lin(c.hidden_size, c.intermediate_size)
        self.mlp.down_proj = lin(c.intermediate_size, c.hidden_size)
        norm = functools.partial(torch.nn.RMSNorm, c.hidden_size, eps=c.rms_norm_eps)
        if input_norm:
            self.input_layernorm = norm()
        if fused:
            self.hidden_norm = norm()
        self.post_attention_layernorm = norm()
        for p in self.parameters():  # norms away from 1, so that a swapped or dropped one shows
            torch.nn.init.normal_(p, 1.0 if p.ndim == 1 else 0.0, 0.3 if p.ndim == 1 else 0.08)

    def forward(self, emb, h):  # [T, D] each -> [T, D]
        c = self.c
        if self.fused:
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1)
        else:
            x = self.input_layernorm(h) if self.has_input_norm else h
        t = x.shape[0]
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        ang = torch.arange(t).float()[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

        def rope(z):
            z1, z2 = z[..., : c.head_dim // 2], z[..., c.head_dim // 2:]
            return z * cos + torch.cat([-z2, z1], -1) * sin

        q = rope(self.self_attn.q_proj(x).view(t, c.num_heads, c.head_dim))
        k = rope(self.self_attn.k_proj(x).view(t, c.num_kv_heads, c.head_dim))
        v = self.self_attn.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        k = k.repeat_interleave(c.num_heads // c.num_kv_heads, 1)
        v = v.repeat_interleave(c.num_heads // c.num_kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / c.head_dim ** 0.5
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
        h = h + self.self_attn.o_proj(attn)
        m = self.post_attention_layernorm(h)
        return h + self.mlp.down_proj(torch.nn.functional.silu(self.mlp.gate_proj(m)) * self.mlp.up_proj(m))


def _released_eagle(path, c, embed, lm_head, eagle3: bool, vocab_ids=None, seed: int = 0):
    """A released EAGLE-1 (`fc` with bias + `layers.0`) or EAGLE-3 (`fc`, `midlayer`, `norm`, `lm_head`, `d2t`,
    `t2d`) checkpoint with the reference's names, saved as `pytorch_model.bin` with its config.json; returns the
    reference forward `(input ids [T], features [T, D or 3D]) -> logits at the last position`."""
    torch.manual_seed(seed)
    d = c.hidden_size
    model = torch.nn.Module()
    model.fc = torch.nn.Linear((3 if eagle3 else 2) * d, d, bias=not eagle3)
    layer = _RefLayer(c, 2 * d if eagle3 else d, input_norm=eagle3, fused=eagle3)
    if eagle3:
        model.midlayer = layer
        model.norm = torch.nn.RMSNorm(d, eps=c.rms_norm_eps)
        torch.nn.init.normal_(model.norm.weight, 1.0, 0.3)
        model.lm_head = torch.nn.Linear(d, len(vocab_ids), bias=False)
        model.register_buffer("d2t", torch.as_tensor(vocab_ids - np.arange(len(vocab_ids)), dtype=torch.long))
        t2d = np.zeros(c.vocab_size, bool)
        t2d[vocab_ids] = True
        model.register_buffer("t2d", torch.as_tensor(t2d))
    else:
        model.layers = torch.nn.ModuleList([layer])
    path.mkdir(parents=True)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": d, "vocab_size": c.vocab_size,
              "num_hidden_layers": 1} | ({"draft_vocab_size": len(vocab_ids)} if eagle3 else {})
    (path / "config.json").write_text(json.dumps(config))
    emb, head = torch.from_numpy(np.array(embed)), torch.from_numpy(np.array(lm_head))

    @torch.no_grad()
    def forward(ids, features):
        h = model.fc(torch.from_numpy(features)) if eagle3 else model.fc(
            torch.cat([emb[torch.as_tensor(ids)], torch.from_numpy(features)], -1))
        out = layer(emb[torch.as_tensor(ids)], h)
        return (model.lm_head(model.norm(out)) if eagle3 else out @ head)[-1].numpy()

    return forward


@pytest.mark.parametrize("fmt", ["eagle", "eagle3"])
def test_released_eagle_heads_give_the_references_logits_and_decode_losslessly(tmp_path, capsys, fmt):
    """Converted EAGLE-1/2 and EAGLE-3 heads, prefilled on a prompt's features, draft the depth-1 distribution the
    reference's forward gives, and decode the target's own greedy text."""
    model = default_model_dir()
    params, config = load_params(model, dtype="float32")
    target = Target(config, params)
    eagle3 = fmt == "eagle3"
    ids = np.sort(np.random.default_rng(1).choice(config.vocab_size, 512, replace=False))
    reference = _released_eagle(tmp_path / "released", config, target.embed(jnp.arange(config.vocab_size)),
                                target.lm_head(), eagle3, ids)
    out = tmp_path / "heads"
    assert main(["convert", "--heads-from", fmt, str(tmp_path / "released"), "--model", str(model), "--out", str(out),
                 "--dtype", "checkpoint"]) == 0
    assert f"as {fmt} heads" in capsys.readouterr().out
    method, drafter, heads = load_draft(out, config, params)
    assert method == fmt and drafter.draft_vocab == (tuple(ids.tolist()) if eagle3 else ())
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, 9)
    width = 3 * config.hidden_size if eagle3 else config.hidden_size
    features = np.random.default_rng(3).standard_normal((9, width)).astype(np.float32)
    root = int(prompt[-1] + 1) % config.vocab_size
    hidden = jnp.asarray(features[None, :, : config.hidden_size])
    ctx = PrefillContext(Output(hidden, None, None, jnp.asarray(features[None]) if eagle3 else None),
                         jnp.asarray(prompt[None]), jnp.asarray([9]), jnp.asarray([root]))
    state = drafter.prefill(heads, target, ctx, drafter.init_state(config, 1, 32))
    ours = np.asarray(drafter.logprobs(heads, target, state["base"]))[0]
    theirs = reference(np.append(prompt[1:], root), features)
    theirs = theirs - np.log(np.exp(theirs - theirs.max()).sum()) - theirs.max()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    gen = Generator.load(model, out, "dynamic-8x3x3")
    prompts = ["def add(a, b):", "import os\n"]
    assert gen.generate(prompts, max_new_tokens=16).token_ids == gen.autoregressive().generate(
        prompts, max_new_tokens=16).token_ids


def test_released_eagle_heads_for_another_target_or_incomplete_are_refused_in_one_line(tmp_path, capsys):
    model = default_model_dir()
    params, config = load_params(model, dtype="float32")
    target = Target(config, params)
    embed, lm_head = target.embed(jnp.arange(config.vocab_size)), target.lm_head()
    ids = np.arange(0, config.vocab_size, 8)
    _released_eagle(tmp_path / "e3", config, embed, lm_head, True, ids)
    wide = dataclasses.replace(config, hidden_size=config.hidden_size + 8)
    _released_eagle(tmp_path / "wide", wide, np.zeros((config.vocab_size, wide.hidden_size), np.float32),
                    np.zeros((wide.hidden_size, config.vocab_size), np.float32), False)
    with pytest.raises(PublishedHeadsError, match="hidden_size 136 but the target has 128"):
        read_eagle(tmp_path / "wide", target)
    state = torch.load(tmp_path / "e3" / "pytorch_model.bin")
    broken = {"missing": {k: v for k, v in state.items() if k != "midlayer.mlp.up_proj.weight"},
              "vocab": state | {"t2d": torch.zeros(config.vocab_size + 10, dtype=torch.bool)},
              "ids": state | {"d2t": state["d2t"] + config.vocab_size}}
    needles = {"missing": "no tensor midlayer.mlp.up_proj.weight", "vocab": "t2d", "ids": "outside"}
    for name, tensors in broken.items():
        (tmp_path / name).mkdir()
        torch.save(tensors, tmp_path / name / "pytorch_model.bin")
        (tmp_path / name / "config.json").write_text((tmp_path / "e3" / "config.json").read_text())
        with pytest.raises(PublishedHeadsError, match=needles[name]):
            read_eagle3(tmp_path / name, target)
    code = main(["convert", "--heads-from", "eagle3", str(tmp_path / "missing"), "--model", str(model), "--out",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == BAD_INPUT_EXIT and len(err.strip().splitlines()) == 1 and "up_proj" in err
    assert not (tmp_path / "out" / "draft.json").exists()
