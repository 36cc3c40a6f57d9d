"""GGUF (llama.cpp's format) -> a Hugging Face directory for the Llama family, without torch.

`convert_gguf(file, out)` dequantises every tensor to fp32 with ggml-org's `gguf` reader, undoes llama.cpp's
per-head row permutation of the query/key projections (its converter reorders them for its rope layout), renames
the tensors to the Hugging Face names `hf.load_params` reads, and writes `config.json`, `model.safetensors`,
`tokenizer.json` (a byte-level BPE built with `tokenizers` from the GGUF vocabulary), `tokenizer_config.json`
(with the chat template) and `generation_config.json`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from amphista_jax.infra.errors import UserError
from amphista_jax.models.config import ModelConfig, RopeScaling
from amphista_jax.models.hf import save_safetensors

ARCHITECTURES = ("llama", "mistral", "qwen2")  # GGUF `general.architecture`s, the same names as HF model types
PERMUTED_ARCHITECTURES = ("llama", "mistral")  # llama.cpp permutes q/k rows for these, not for qwen2
TENSOR_TYPES = tuple(gguf.GGMLQuantizationType[n] for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))

_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER_NAMES = {  # GGUF name after `blk.N.` -> HF name after `model.layers.N.`
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{g}.{p}": f"self_attn.{h}_proj.{p}" for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
       for p in ("weight", "bias")},
    **{f"ffn_{g}.{p}": f"mlp.{g}_proj.{p}" for g in ("gate", "up", "down") for p in ("weight", "bias")},
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")

_GPT2_BYTES = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
_SPLIT_BYTES = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # after a Split of our own
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
           r"\s+(?!\S)|\s+")
PRE_TOKENIZERS = {  # `tokenizer.ggml.pre` -> the pre-tokenizer llama.cpp applies for it
    "default": [_GPT2_BYTES],
    "gpt-2": [_GPT2_BYTES],
    "smollm": [pre_tokenizers.Digits(individual_digits=True), _GPT2_BYTES],
    "llama-bpe": [pre_tokenizers.Split(Regex(_LLAMA3), "isolated"), _SPLIT_BYTES],
    "qwen2": [pre_tokenizers.Split(Regex(_LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")), "isolated"), _SPLIT_BYTES],
}
_CONTROL, _USER_DEFINED = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)


class GGUFError(UserError, ValueError):
    """A GGUF file this converter cannot read or does not support."""


def convert_gguf(path: str | Path, out: str | Path) -> ModelConfig:
    """Write the Hugging Face directory of the GGUF model at `path` into `out` (created); return its config."""
    reader = _reader(Path(path))
    meta = _metadata(reader)
    config = gguf_config(meta, {t.name for t in reader.tensors})
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = dict(_hf_tensors(reader, config))
    save_safetensors(tensors, out / "model.safetensors")
    hf = config.to_hf_dict() | {"torch_dtype": "float32", "dtype": "float32"}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    write_tokenizer(meta, out, config)
    return config


def _reader(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file ({e}); re-download it or pick another file") from None


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """The model's `ModelConfig` from GGUF metadata (`tensor_names` tell tied embeddings and biases)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError("this GGUF scales rope by a rope_freqs tensor (Llama 3.1 style), which the converter does "
                        "not support; convert the original Hugging Face checkpoint instead")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFError(f"GGUF metadata lacks {arch}.{name}: the file is incomplete; re-download it")
        return value

    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(f"rope over {key('rope.dimension_count')} of {head_dim} head dims (partial rotary) is not "
                        "supported")
    layers = int(key("block_count"))
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(key("vocab_size", len(meta.get("tokenizer.ggml.tokens") or []) or None)),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        sliding_windows=(window,) * layers if arch == "mistral" else (),
        model_type=arch,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


def _rope_scaling(meta: dict[str, Any], arch: str) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind != "linear":
        raise GGUFError(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear")
    return RopeScaling(rope_type="linear", factor=float(meta[f"{arch}.rope.scaling.factor"]))


def hf_name(name: str) -> str:
    """The Hugging Face name of GGUF tensor `name`."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    layer = _LAYER.fullmatch(name)
    if layer is None or layer.group(2) not in _LAYER_NAMES:
        raise GGUFError(f"GGUF tensor {name!r} has no Hugging Face Llama counterpart: this is not a plain "
                        f"{'/'.join(ARCHITECTURES)} model")
    return f"model.layers.{layer.group(1)}.{_LAYER_NAMES[layer.group(2)]}"


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: per head, rows `[r0, r_half, r1, r_half+1, ...]` back to `[r0, r1, ..., r_half,
    ...]` (its rope rotates adjacent pairs, HF's rotates halves). Works on weights `[H*Dh, D]` and biases."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor: Any) -> np.ndarray:
    """One GGUF tensor as fp32 numpy, in the Hugging Face (rows = outputs) orientation."""
    if tensor.tensor_type not in TENSOR_TYPES:
        raise GGUFError(f"GGUF tensor {tensor.name!r} is {tensor.tensor_type.name}, which the converter does not "
                        f"support; supported: {', '.join(t.name for t in TENSOR_TYPES)}")
    out = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    return out.reshape(tuple(reversed([int(n) for n in tensor.shape])))


def _hf_tensors(reader: gguf.GGUFReader, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    for tensor in tqdm(reader.tensors, desc="dequantise", unit="tensor", leave=False):
        name = hf_name(tensor.name)
        w = dequantize(tensor)
        proj = name.split(".")[-2]
        if config.model_type in PERMUTED_ARCHITECTURES and proj in heads:
            w = unpermute(w, heads[proj])
        yield name, np.ascontiguousarray(w)


def write_tokenizer(meta: dict[str, Any], out: Path, config: ModelConfig) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and generation_config.json from the
    GGUF's `tokenizer.ggml.*` metadata."""
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos"),
                  "eos_token": token("eos"), "pad_token": token("padding"), "unk_token": token("unknown"),
                  "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                  "clean_up_tokenization_spaces": False, "model_max_length": config.max_position_embeddings}
    if "tokenizer.chat_template" in meta:
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids[0] if
                  config.eos_token_ids else None, "pad_token_id": config.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The byte-level BPE tokenizer a `gpt2`-model GGUF describes (vocabulary, merges, pre-tokenizer, special
    tokens, BOS when `add_bos_token`)."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GGUFError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2 (byte-level BPE)")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     ignore_merges=pre == "llama-bpe"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(PRE_TOKENIZERS[pre])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, k in zip(tokens, types, strict=True) if k == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types, strict=True)
                          if k == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        b = tokens[int(bos)]
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{b} $A", pair=f"{b} $A {b} $B",
                                                                 special_tokens=[(b, int(bos))])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer
