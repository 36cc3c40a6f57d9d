"""Write tiny GGUF files the way llama.cpp's `convert_hf_to_gguf.py` does, for the GGUF and fetch tests:
HF tensors renamed, q/k rows permuted per head (llama, mistral), quantised with `gguf.quants.quantize`, and a
byte-level BPE vocabulary with merges and control tokens."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file
from tokenizers.pre_tokenizers import ByteLevel

from amphista_jax.models.config import ModelConfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "t he", "Ġt he", "i n", "Ġ a", "1 2", "Ġ 1", "o n", "e r"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_HF_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
_LAYER_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                  **{f"self_attn.{h}_proj.{p}": f"attn_{g}.{p}" for h, g in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                               ("o", "output"))
                     for p in ("weight", "bias")},
                  **{f"mlp.{g}_proj.weight": f"ffn_{g}.weight" for g in ("gate", "up", "down")}}


def vocabulary() -> list[str]:
    """Special tokens, the 256 byte-level symbols, then one token per merge."""
    return SPECIALS + sorted(ByteLevel.alphabet()) + ["".join(m.split()) for m in MERGES]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """`LlamaModel.permute` of llama.cpp's convert_hf_to_gguf.py (rows reordered per head for its rope)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_LAYER_TO_GGUF[rest]}"


def llama_cpp_tensors(hf_dir: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """The HF checkpoint's tensors under llama.cpp's names, q/k permuted as llama.cpp does (not for qwen2)."""
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    out = {}
    for hf, w in load_file(str(hf_dir / "model.safetensors")).items():
        name = gguf_name(hf)
        kind = name.split(".")[-2]
        if config.model_type != "qwen2" and kind in heads:
            w = llama_cpp_permute(w, heads[kind])
        out[name] = w.astype(np.float32)
    return out


def write_gguf(path: Path, config: ModelConfig, tensors: dict[str, np.ndarray], qtype: str = "F32",
               arch: str | None = None, pre: str = "smollm") -> Path:
    """A GGUF at `path`: `config`'s metadata, the vocabulary above, and `tensors` (2-D weights quantised to
    `qtype`, norms and biases in F32, as llama.cpp keeps them)."""
    arch = arch or config.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_rope_dimension_count(config.head_dim)
    if any(config.sliding_windows):
        w.add_sliding_window(config.sliding_windows[0])
    tokens = vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens + [f"<unused{i}>" for i in range(config.vocab_size - len(tokens))])
    w.add_token_types([int(gguf.TokenType.CONTROL)] * len(SPECIALS) + [int(gguf.TokenType.NORMAL)] * (
        config.vocab_size - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, t in tensors.items():
        kind = gguf.GGMLQuantizationType[qtype if t.ndim == 2 else "F32"]
        if kind.name in ("F32", "F64"):  # F64: a type the converter refuses
            w.add_tensor(name, t.astype(np.float64 if kind.name == "F64" else np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(t, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
