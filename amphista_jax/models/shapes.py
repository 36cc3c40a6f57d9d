"""Architectures of the targets the papers evaluate, by name: their Hugging Face `config.json` shapes, for
plans and roofline predictions where the checkpoint itself is not at hand."""

from __future__ import annotations

from collections.abc import Callable

from amphista_jax.models.config import ConfigError, ModelConfig, tiny_llama_config

KNOWN_TARGETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny_llama_config,
    "smollm2-135m": lambda: ModelConfig(49152, 576, 1536, 30, 9, 3, 64, rms_norm_eps=1e-5, rope_theta=100000.0,
                                        max_position_embeddings=8192, tie_word_embeddings=True),
    "vicuna-7b": lambda: ModelConfig(32000, 4096, 11008, 32, 32, 32, 128, max_position_embeddings=2048),
    "vicuna-13b": lambda: ModelConfig(32000, 5120, 13824, 40, 40, 40, 128, max_position_embeddings=2048),
    "vicuna-33b": lambda: ModelConfig(32000, 6656, 17920, 60, 52, 52, 128, max_position_embeddings=2048),
    "llama-3-8b": lambda: ModelConfig(128256, 4096, 14336, 32, 32, 8, 128, rms_norm_eps=1e-5, rope_theta=500000.0,
                                      max_position_embeddings=8192),
    "llama-3-70b": lambda: ModelConfig(128256, 8192, 28672, 80, 64, 8, 128, rms_norm_eps=1e-5,
                                       rope_theta=500000.0, max_position_embeddings=8192),
    # Qwen3-8B's shape (DFlash's reference target) as a Llama-family decoder: the same matrices; Qwen3's per-head
    # q/k norms (2 x 128 weights a layer) are left out, which no plan or roofline can see
    "qwen3-8b": lambda: ModelConfig(151936, 4096, 12288, 36, 32, 8, 128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                    max_position_embeddings=40960),
}


def known_target(name: str) -> ModelConfig:
    if name not in KNOWN_TARGETS:
        raise ConfigError(f"target shape {name!r} is not known; known: {', '.join(KNOWN_TARGETS)}")
    return KNOWN_TARGETS[name]()
