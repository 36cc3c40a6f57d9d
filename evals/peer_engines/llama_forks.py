"""What medusa-llm's and eagle-llm's forked Llamas (`medusa.model.modeling_llama_kv`, `eagle.model.modeling_llama_kv`:
one transformers-4 Llama, copied into each package) need under transformers 5 and for a target whose RoPE base is
not 10000,. Each fix takes the fork's module:

- `fix_rope`: the fork's `LlamaAttention._init_rope` reads `config.rope_scaling["type"]`, and transformers 5 fills
  `rope_scaling` with `{"rope_type": "default", "rope_theta": ...}` where a checkpoint names no scaling (KeyError);
  and it builds `LlamaRotaryEmbedding(head_dim, max_position_embeddings)` at the hard-coded base 10000, whatever the
  config's `rope_theta` (SmolLM2: 100000; its logits off by up to ~10). Plain RoPE is built at the config's base:
  this one CHANGES what the fork computes, to the target as trained (transformers' own Llama). A config that names
  a scaling is refused in one line (the fork's scaled variants keep the hard-coded base).
- `fix_tied_weights`: the fork's transformers-4 list `_tied_weights_keys = ["lm_head.weight"]` makes transformers 5's
  `post_init` raise AttributeError; its dict form ties the LM head to the embedding as transformers 4 did.
- `rebuild_rotary`: transformers 5's `from_pretrained` builds modules on the meta device and restores only the
  checkpoint's tensors, so the rotary buffers (`inv_freq`, absent from the checkpoint; the `cos`/`sin` caches) come
  back as garbage and zeros: each layer's rotary embedding is built again, as the fork's constructor builds it.
"""

from __future__ import annotations

import types

import torch
from transformers import PretrainedConfig


def rope_theta(config: PretrainedConfig) -> float:
    """The config's RoPE base (transformers 5 keeps it in `rope_parameters`), 10000 where it names none."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def fix_rope(fork: types.ModuleType) -> None:
    """`fork.LlamaAttention._init_rope` builds plain RoPE at the config's base (see the module docstring)."""

    def _init_rope(self: torch.nn.Module) -> None:
        scaling = self.config.rope_scaling
        if isinstance(scaling, dict) and scaling.get("type", scaling.get("rope_type")) not in (None, "default"):
            raise ValueError(f"the forked Llama of {fork.__name__} runs RoPE scaling {scaling} at base 10000: only "
                             "unscaled RoPE is run at the config's base here")
        self.rotary_emb = fork.LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=self.max_position_embeddings,
                                                    base=rope_theta(self.config))

    fork.LlamaAttention._init_rope = _init_rope


def fix_tied_weights(fork: types.ModuleType) -> None:
    """`fork.LlamaForCausalLM._tied_weights_keys` in transformers 5's dict form."""
    fork.LlamaForCausalLM._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}


def rebuild_rotary(model: torch.nn.Module) -> None:
    """Each layer's rotary embedding of a loaded fork built again by its (fixed) `_init_rope`, on the model's
    device; the LM head checked to be the embedding where the config ties them."""
    for layer in model.model.layers:
        attn = layer.self_attn
        with torch.device(attn.q_proj.weight.device):
            attn._init_rope()
    if getattr(model.config, "tie_word_embeddings", False) and not torch.equal(model.lm_head.weight,
                                                                              model.model.embed_tokens.weight):
        raise ValueError("the fork's LM head is not tied to its embedding as the config asks")

