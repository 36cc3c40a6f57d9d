"""The evaluation's settings: `EvalConfig`, read from a YAML under `configs/eval/` (`amphista-jax eval --config`),
each field overridable with `--set key=value`; its invariants are checked when it is made, before any weights load.
"""

from __future__ import annotations

import dataclasses

from amphista_jax.engine.decode_spec import check_decode_settings
from amphista_jax.evals.datasets import DatasetConfig
from amphista_jax.infra.errors import UserError
from amphista_jax.models.attention import AttentionBackend
from amphista_jax.models.hf import DTYPES
from amphista_jax.train.config import DataConfig, MeshConfig
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.verify import AcceptanceConfig


class EvalConfigError(UserError, ValueError):
    """An eval config that cannot work with its model: found before any weights load."""


ORDERS = ("method", "prompt")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    dataset: DatasetConfig = DatasetConfig()
    methods: tuple[str, ...] = ("ar",)  # specs, see amphista_jax.evals.methods; the AR baseline is always run first
    out_dir: str = "runs/eval/default"
    model: str = ""  # HF checkpoint directory, a fetched name (smollm2) or tiny; "" = `fetch.default_model()`
    tree: str = "mc_sim_7b_63"  # default tree of every draft method (a spec's `@tree` overrides it)
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    acceptance: str | None = None  # None: greedy at temperature 0, lossless rejection sampling otherwise
    batch_size: int = 1
    dtype: str = "float32"
    seed: int = 0
    pad_multiple: int = 64
    attention: str = "xla"
    heldout: DataConfig = DataConfig(kind="stdlib")  # per-head accuracy data
    heldout_batches: int = 4  # 0 = skip per-head accuracy
    allow_mismatch: bool = False  # exit 0 even when a method's greedy output differs from AR's
    mesh: MeshConfig | None = None  # None = one device; sizes multiply to each process's device count
    # method: each method through every prompt in turn; prompt: every method on a batch before the next batch (the
    # ratios of a run then hold when the machine's speed drifts during it)
    order: str = "method"

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.pad_multiple < 1:
            raise ValueError(f"batch_size={self.batch_size} and pad_multiple={self.pad_multiple} must both be >= 1")
        if not self.methods:
            raise ValueError("methods is empty: give at least `ar`")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} must be one of {', '.join(DTYPES)}")
        AttentionBackend.parse(self.attention)
        if self.order not in ORDERS:
            raise ValueError(f"order {self.order!r} must be one of {', '.join(ORDERS)}")
        if self.heldout_batches < 0:
            raise ValueError(f"heldout_batches={self.heldout_batches} must be >= 0 (0 = skip per-head accuracy)")
        check_decode_settings(self.max_new_tokens, SamplingConfig(self.temperature, self.top_k, self.top_p),
                              AcceptanceConfig(self.acceptance))

    @property
    def lossless_checked(self) -> bool:
        return self.temperature == 0.0
