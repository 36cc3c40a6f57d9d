"""Heads released in other projects' layouts: torch files read without torch, Medusa's released heads converted
into ours (same logits as the reference's forward, lossless decoding, refused for another target)."""

from __future__ import annotations

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
from amphista_jax.drafters.io import load_draft
from amphista_jax.drafters.published import PublishedHeadsError, read_medusa
from amphista_jax.errors import BAD_INPUT_EXIT
from amphista_jax.models.hf import load_params
from amphista_jax.models.torch_files import TensorFileError, read_safetensors, read_torch_file
from amphista_jax.target import Target


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
def test_released_medusa_heads_give_the_references_logits_and_decode_losslessly(tmp_path, capsys, layers):
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
