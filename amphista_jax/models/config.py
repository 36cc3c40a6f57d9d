"""Target-model configuration: one frozen dataclass for the Llama family, parsed from HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from amphista_jax.infra.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(UserError, ValueError):
    """A model configuration that this library cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as in HF `rope_scaling` / `rope_parameters`."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope type {self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Vicuna, Mistral, Qwen2).

    `sliding_windows` has one entry per layer: 0 means full attention, w > 0 means a query at position p
    sees keys at positions > p - w (HF semantics).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple[int, ...] = ()
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (0,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ConfigError(f"{len(self.sliding_windows)=} must equal {self.num_layers=}")

    @property
    def max_positions(self) -> int:
        """Positions the model can attend over: `max_position_embeddings`, stretched by a linear or dynamic rope
        `factor` (HF keeps the pre-scaling length there); llama3 configs already state the extended length."""
        if self.rope_scaling.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * self.rope_scaling.factor)
        return self.max_position_embeddings

    @property
    def num_params(self) -> int:
        d, f, h, kv, hd = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * h * hd * 2 + d * kv * hd * 2 + (h + 2 * kv) * hd * self.qkv_bias + d * self.o_bias
        mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
        layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + d

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face config dict (transformers v4 `rope_scaling` or v5 `rope_parameters`)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU MLP) is")
        num_layers = int(cfg["num_hidden_layers"])
        num_heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        known = {f.name for f in dataclasses.fields(RopeScaling)}
        scaling = RopeScaling(rope_type=rope_type, **{k: v for k, v in rope.items() if k in known})
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(cfg, model_type, num_layers),
            model_type=model_type,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """`config.json` parsed and checked field by field: a file that is not JSON, a missing field or a value of
        the wrong kind is a one-line `ConfigError` naming the file and the field."""
        try:
            cfg = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON ({e}): the checkpoint's config is damaged; restore it "
                              "or re-save the model") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path} holds a JSON {type(cfg).__name__}, not a config object")
        try:
            return cls.from_hf_dict(cfg)
        except KeyError as e:
            raise ConfigError(f"{path} has no {e.args[0]!r}: a Llama-family config.json needs it") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{path}: a field has a value of the wrong kind ({e}): fix it") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` dict that `transformers` (v4 and v5) loads as the same architecture."""
        architectures = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        rope: dict[str, Any] = {"rope_type": self.rope_scaling.rope_type, "rope_theta": self.rope_theta}
        if self.rope_scaling.rope_type != "default":
            rope |= {"factor": self.rope_scaling.factor}
        if self.rope_scaling.rope_type == "llama3":
            rope |= {
                "low_freq_factor": self.rope_scaling.low_freq_factor,
                "high_freq_factor": self.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": self.rope_scaling.original_max_position_embeddings,
            }
        out: dict[str, Any] = {
            "architectures": [architectures[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling.rope_type == "default" else rope,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else
            (self.eos_token_ids[0] if self.eos_token_ids else None),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "bfloat16",
        }
        if self.model_type == "llama":
            out |= {"attention_bias": self.o_bias, "mlp_bias": self.mlp_bias}
        windows = set(self.sliding_windows) - {0}
        if self.model_type == "mistral":
            out["sliding_window"] = windows.pop() if windows else None
        if self.model_type == "qwen2":
            first = next((i for i, w in enumerate(self.sliding_windows) if w), self.num_layers)
            out |= {"use_sliding_window": bool(windows), "sliding_window": windows.pop() if windows else None,
                    "max_window_layers": first,
                    "layer_types": ["sliding_attention" if w else "full_attention" for w in self.sliding_windows]}
        return out


def _sliding_windows(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    window = cfg.get("sliding_window")
    if model_type == "mistral":
        return (int(window or 0),) * num_layers
    if model_type == "qwen2" and cfg.get("use_sliding_window") and window:
        types = cfg.get("layer_types")
        if types is None:
            first = int(cfg.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return (0,) * num_layers


def tiny_llama_config(**overrides: Any) -> ModelConfig:
    """A tiny random-init architecture for tests and smoke runs."""
    base: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=512, eos_token_ids=(2,), bos_token_id=1,
    )
    return ModelConfig(**(base | overrides))
