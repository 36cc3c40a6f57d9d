"""GGUF -> Hugging Face conversion: tiny random Llama-family models written to GGUF in llama.cpp's layout (permuted
q/k, F32 / Q8_0 / Q4_1 tensors) convert back to the same weights and logits; the tokenizer round-trips."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from amphista_jax.cli import main
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.gguf import GGUFError, convert_gguf, unpermute
from amphista_jax.models.hf import load_params, save_params
from amphista_jax.models.llama import Transformer, param_shapes
from amphista_jax.models.tokenizer import load_tokenizer
from tests.gguf_writer import SPECIALS, llama_cpp_permute, llama_cpp_tensors, vocabulary, write_gguf

BASE = dict(vocab_size=288, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, head_dim=16,
            rms_norm_eps=2.0**-17, rope_theta=10000.0, max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,),
            pad_token_id=0)
VARIANTS = {
    "llama-gqa": ModelConfig(**BASE, num_kv_heads=2),
    "mistral-window": ModelConfig(**BASE, num_kv_heads=2, model_type="mistral", sliding_windows=(6, 6)),
    "qwen2-tied-bias": ModelConfig(**BASE, num_kv_heads=1, model_type="qwen2", qkv_bias=True,
                                   tie_word_embeddings=True),
}
# max |logit error| / max |logit| that quantising these tiny random models may cause (measured: Q8_0 0.03, Q4_1
# 0.29); the exact check is against ggml's own quantise/dequantise round trip
QUANT_RTOL = {"Q8_0": 0.1, "Q4_1": 0.6}


def random_checkpoint(config: ModelConfig, path: Path, seed: int = 0) -> Path:
    """A random HF checkpoint of `config` (fp32; norms around 1, random biases so their path shows)."""
    rng = np.random.default_rng(seed)
    shapes, _ = param_shapes(config)
    params = jax.tree_util.tree_map_with_path(
        lambda p, s: (float("scale" in str(p[-1])) + 0.1 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
    return save_params(params, config, path, dtype="float32")


def logits(path: Path) -> np.ndarray:
    params, config = load_params(path)
    tokens = np.random.RandomState(1).randint(0, config.vocab_size, (2, 12))
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    return np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(tokens), positions).logits)


def to_gguf_and_back(tmp_path: Path, variant: str, qtype: str) -> tuple[Path, Path]:
    config = VARIANTS[variant]
    hf = random_checkpoint(config, tmp_path / "hf")
    file = write_gguf(tmp_path / "model.gguf", config, llama_cpp_tensors(hf, config), qtype)
    convert_gguf(file, tmp_path / "converted")
    return hf, tmp_path / "converted"


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    for heads in (1, 2, 4):
        assert not np.array_equal(llama_cpp_permute(w, heads), w)
        np.testing.assert_array_equal(unpermute(llama_cpp_permute(w, heads), heads), w)
    bias = np.arange(32, dtype=np.float32)
    np.testing.assert_array_equal(unpermute(llama_cpp_permute(bias, 4), 4), bias)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_f32_gguf_converts_to_identical_weights_and_logits(tmp_path, variant):
    hf, converted = to_gguf_and_back(tmp_path, variant, "F32")
    ours, config = load_params(converted)
    ref, _ = load_params(hf)
    assert config == VARIANTS[variant]
    jax.tree.map(np.testing.assert_array_equal, ours, ref)
    np.testing.assert_array_equal(logits(converted), logits(hf))


def ggml_round_trip(hf: Path, qtype: str, out: Path) -> Path:
    """`hf` with every matrix quantised and dequantised by ggml's own code, row by row as GGUF stores it."""
    kind = gguf.GGMLQuantizationType[qtype]
    tensors = {n: gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind) if w.ndim == 2 else w
               for n, w in load_file(str(hf / "model.safetensors")).items()}
    out.mkdir()
    shutil.copy(hf / "config.json", out / "config.json")
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("qtype", sorted(QUANT_RTOL))
def test_quantised_gguf_converts_within_quantisation_error(tmp_path, qtype):
    hf, converted = to_gguf_and_back(tmp_path, "llama-gqa", qtype)
    expected = ggml_round_trip(hf, qtype, tmp_path / "expected")
    jax.tree.map(np.testing.assert_array_equal, load_params(converted)[0], load_params(expected)[0])
    got, want = logits(converted), logits(hf)
    np.testing.assert_array_equal(got, logits(expected))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err < QUANT_RTOL[qtype], err


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    _, converted = to_gguf_and_back(tmp_path, "llama-gqa", "F32")
    tok = load_tokenizer(converted)
    vocab = vocabulary()
    for text in ["the cat in the hat", "héllo wörld 🙂\n\tx = 12 + 345", "<|im_start|>user\nhi<|im_end|>"]:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        assert tok.decode(ids) == text
    assert tok(" the")["input_ids"] == [vocab.index("Ġthe")]  # merges applied
    assert tok("<|im_end|>")["input_ids"] == [SPECIALS.index("<|im_end|>")]  # control tokens are atomic
    digits = tok.convert_ids_to_tokens(tok("x 12")["input_ids"])
    assert digits == ["x", "Ġ", "1", "2"]  # smollm splits digits one by one, so the "1 2" merge never applies
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2


def test_unsupported_architecture_is_one_line(tmp_path):
    config = VARIANTS["llama-gqa"]
    file = write_gguf(tmp_path / "m.gguf", config, llama_cpp_tensors(random_checkpoint(config, tmp_path / "hf"),
                                                                     config), arch="gemma")
    with pytest.raises(GGUFError, match=r"^GGUF architecture 'gemma' is not supported; supported: llama, mistral"):
        convert_gguf(file, tmp_path / "out")


def test_unsupported_tensor_type_is_one_line_from_the_cli(tmp_path, capsys):
    config = VARIANTS["llama-gqa"]
    tensors = llama_cpp_tensors(random_checkpoint(config, tmp_path / "hf"), config)
    file = write_gguf(tmp_path / "m.gguf", config, tensors, qtype="F64")
    assert main(["convert", "--gguf", str(file), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is F64, which the converter does not support; supported: F32, F16" in err


def test_cli_converts_a_gguf(tmp_path, capsys):
    config = VARIANTS["qwen2-tied-bias"]
    file = write_gguf(tmp_path / "m.gguf", config, llama_cpp_tensors(random_checkpoint(config, tmp_path / "hf"),
                                                                     config), qtype="Q8_0")
    assert main(["convert", "--gguf", str(file), "--out", str(tmp_path / "out")]) == 0
    assert f"saved {config.num_params:,} parameters" in capsys.readouterr().out
    assert load_params(tmp_path / "out")[1] == config
