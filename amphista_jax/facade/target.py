"""A target loaded once: its weights in the decode layout, its tokenizer and stop ids, its mesh, and the one cache of
compiled programs that every drafter and tree attached to it shares.

    target = LoadedTarget.load("smollm2")                         # from a directory or a fetched name
    target = LoadedTarget.from_params(config, params)             # weights in hand (tests, benchmarks)
    gen = Generator.load(target, heads="hydra")                   # the facade attaches drafters to it

A program is keyed by everything that shapes it: the prompt shape, the `DecodeSpec` (drafter settings and tree
included), the cache size and the abstract shapes of the draft params. Two drafters on one target therefore share the
target's weights and reuse each other's autoregressive programs; `release_programs` drops the whole cache. A draft
model's params are kept here too, read once for all its trees and decoding settings (`draft_models`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from amphista_jax.drafters.base import Drafter
from amphista_jax.engine.decode import decode
from amphista_jax.engine.decode_spec import DecodeSpec
from amphista_jax.infra.compile_cache import enable_compile_cache
from amphista_jax.infra.home import amphista_home
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.target import Target

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ParamsSignature = tuple  # (tree structure, ((shape, dtype), ...)): what a program compiled for draft params fixes


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedTarget:
    """A target's weights, tokenizer, stop ids and mesh, loaded once, and the programs compiled on them."""

    config: ModelConfig
    params: dict  # in the decode layout (`layout="split"`), placed on `mesh` when there is one
    tokenizer: PreTrainedTokenizerBase | None  # None: no text (only token ids decode)
    eos_ids: tuple[int, ...]
    model_dir: str = ""  # "" for weights in hand
    attention: str = "xla"
    mesh: jax.sharding.Mesh | None = None
    programs: dict[tuple, jax.stages.Compiled] = dataclasses.field(default_factory=dict, repr=False)
    # draft models' (drafter, params) as read once and kept, by `drafter_source.draft_model_key`: shared by every
    # attachment of one (its trees and decoding settings)
    draft_models: dict[tuple, tuple[Drafter, Any]] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def load(cls, model_dir: str | Path, config: ModelConfig, *, dtype: str = "float32",
             mesh: jax.sharding.Mesh | None = None, attention: str = "xla") -> LoadedTarget:
        """The target in the Hugging Face directory `model_dir` (its `config` read already), in `dtype`, placed on
        `mesh` by its logical axes; the persistent compile cache is switched on."""
        from amphista_jax.engine.sharding import param_shardings
        from amphista_jax.models.hf import load_params
        from amphista_jax.models.tokenizer import load_tokenizer, stop_token_ids

        enable_compile_cache(amphista_home())
        tokenizer = load_tokenizer(model_dir)
        shardings = param_shardings(config, mesh, split=True) if mesh is not None else None
        params, config = load_params(model_dir, dtype=dtype, shardings=shardings, layout="split")
        return cls(config, params, tokenizer, stop_token_ids(model_dir, tokenizer, config), str(model_dir),
                   attention, mesh)

    @classmethod
    def from_params(cls, config: ModelConfig, params: dict, tokenizer: PreTrainedTokenizerBase | None = None,
                    eos_ids: tuple[int, ...] = (), *, model_dir: str | Path = "", attention: str = "xla",
                    mesh: jax.sharding.Mesh | None = None) -> LoadedTarget:
        """A target whose weights are in hand (a test's or a benchmark's random weights, or params loaded by the
        caller): the one door for in-memory weights. `model_dir` names where they came from, if anywhere."""
        return cls(config, params, tokenizer, tuple(eos_ids), str(model_dir), attention, mesh)

    @property
    def view(self) -> Target:
        """The target as drafters read it (`models.target.Target`)."""
        return Target(self.config, self.params)

    @property
    def dtype(self) -> str:
        """The parameter dtype (`float32`, `bfloat16`)."""
        return jax.tree.leaves(self.params)[0].dtype.name

    @property
    def pad_id(self) -> int:
        return self.config.pad_token_id or 0

    def on_mesh(self) -> contextlib.AbstractContextManager:
        from amphista_jax.engine.sharding import on_mesh

        return on_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def program(self, tokens: np.ndarray, lengths: np.ndarray, spec: DecodeSpec, draft_params: Any,
                cache_size: int) -> tuple[jax.stages.Compiled, float]:
        """(the compiled `decode` program for `tokens [B, T]`, `spec`, `cache_size` and params shaped as
        `draft_params`, seconds spent compiling it now: 0 when cached)."""
        key = (tokens.shape, spec, cache_size, signature(draft_params))
        if key in self.programs:
            return self.programs[key], 0.0
        t0 = time.perf_counter()
        with self.on_mesh():
            lowered = decode.lower(self.params, draft_params, tokens, lengths, jax.random.key(0), spec=spec,
                                   cache_size=cache_size)
            self.programs[key] = lowered.compile()
        return self.programs[key], time.perf_counter() - t0

    def release_programs(self) -> None:
        """Drop every program compiled on this target (`compiled_programs`: a process holding many runs out of
        memory mappings); each compiles again when next needed."""
        self.programs.clear()

    def release_draft_models(self) -> None:
        """Drop the draft models' params kept for this target (`draft_models`); the generators attached hold theirs,
        and the next attachment of a draft model reads its directory again."""
        self.draft_models.clear()


def signature(params: Any) -> ParamsSignature:
    """What a compiled program fixes of `params`: their tree structure and each leaf's shape and dtype."""
    leaves, tree = jax.tree.flatten(params)
    return tree, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)
