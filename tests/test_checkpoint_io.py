"""Checkpoint I/O: round trips, sharded indexes, dtypes, and a clear error for each kind of bad input."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from amphista_jax.models.config import ConfigError, tiny_llama_config
from amphista_jax.models.hf import INDEX_FILE, CheckpointError, load_params, save_params
from amphista_jax.models.llama import init_params
from amphista_jax.models.param_layout import split_layers

CONFIG = tiny_llama_config(qkv_bias=True, model_type="qwen2")


@pytest.fixture
def saved(tmp_path):
    params = init_params(CONFIG, jax.random.key(0))
    save_params(params, CONFIG, tmp_path / "ckpt", dtype="float32")
    return params, tmp_path / "ckpt"


def _assert_same(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_round_trip_single_and_sharded_index(saved, tmp_path):
    params, path = saved
    loaded, config = load_params(path)
    assert config == CONFIG
    _assert_same(params, loaded)
    save_params(params, CONFIG, tmp_path / "sharded", dtype="float32", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2
    _assert_same(params, load_params(tmp_path / "sharded")[0])


def test_split_layout_loads_and_saves(saved, tmp_path):
    """`layout="split"` reads decoding's one-tree-per-layer layout straight from the files (== `split_layers` of
    the stacked load), also from a sharded index, and saving it writes the same checkpoint."""
    params, path = saved
    loaded, _ = load_params(path, layout="split")
    assert "layers" not in loaded and sorted(k for k in loaded if k.startswith("layer_")) == ["layer_0", "layer_1"]
    _assert_same(split_layers(params), loaded)
    save_params(loaded, CONFIG, tmp_path / "from_split", dtype="float32", max_shard_bytes=40_000)
    _assert_same(params, load_params(tmp_path / "from_split")[0])
    _assert_same(split_layers(params), load_params(tmp_path / "from_split", layout="split")[0])
    with pytest.raises(CheckpointError, match="layout 'scan' is not one of stacked, split"):
        load_params(path, layout="scan")


def test_dtype_choice(saved, tmp_path):
    params, path = saved
    assert {x.dtype for x in jax.tree.leaves(load_params(path, dtype="bfloat16")[0])} == {jnp.dtype("bfloat16")}
    save_params(params, CONFIG, tmp_path / "bf16")  # default: bf16 on disk
    kept = load_params(tmp_path / "bf16", dtype="checkpoint")[0]
    assert {x.dtype for x in jax.tree.leaves(kept)} == {jnp.dtype(ml_dtypes.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(load_params(tmp_path / "bf16", dtype="float32")[0])} == {
        jnp.dtype("float32")}


def test_unsupported_model_type(saved):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text()) | {"model_type": "gpt2"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"model_type 'gpt2' is not supported; supported: llama, mistral, qwen2"):
        load_params(path)


def test_truncated_safetensors(saved):
    _, path = saved
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_params(path)


def test_shape_mismatch(saved):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text()) | {"intermediate_size": 100}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"down_proj.weight' has shape \(64, 128\) but config.json implies "
                                              r"\(64, 100\)"):
        load_params(path)


def test_missing_files(saved, tmp_path):
    _, path = saved
    with pytest.raises(CheckpointError, match="does not exist"):
        load_params(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_params(tmp_path / "empty")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no model.safetensors or model.safetensors.index.json"):
        load_params(path)


def test_missing_tensor_and_missing_shard(saved, tmp_path):
    params, path = saved
    untied = tiny_llama_config()
    save_params(init_params(untied, jax.random.key(0)), untied, tmp_path / "untied", dtype="float32")
    cfg = json.loads((tmp_path / "untied" / "config.json").read_text())
    # A checkpoint saved tied but configured untied lacks lm_head.weight.
    tied = tiny_llama_config(tie_word_embeddings=True)
    save_params(init_params(tied, jax.random.key(0)), tied, tmp_path / "tied", dtype="float32")
    (tmp_path / "tied" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="tensor 'lm_head.weight' is missing"):
        load_params(tmp_path / "tied")
    save_params(params, CONFIG, tmp_path / "sharded", dtype="float32", max_shard_bytes=40_000)
    next((tmp_path / "sharded").glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="names shard 'model-00002-of"):
        load_params(tmp_path / "sharded")


def test_saved_checkpoint_loads_in_transformers(saved):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    params, path = saved
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = np.arange(12).reshape(1, 12) % CONFIG.vocab_size
    from amphista_jax.models.llama import Transformer

    ours = Transformer(CONFIG).apply({"params": params}, jnp.asarray(tokens), jnp.arange(12)[None]).logits
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-4)
