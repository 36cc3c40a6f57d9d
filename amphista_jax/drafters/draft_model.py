"""A small model of the target's family as the drafter: classic draft-model speculative decoding on our engine.

Any Llama-family Hugging Face checkpoint that shares the target's tokenizer drafts for it (`from_pretrained`):
its own embedding, decoder layers, norm and `lm_head`, with its own KV cache. It reads nothing of the target
(one made from the target copies the target's weights once, at `init`).

Cache convention (one ahead of the target's): the root — the target's own next token, certain to be committed
— is committed in the draft model's cache already, so it holds the committed text and the root, and its output
there (`state["base"]`, after the final norm) gives the root's children. `prefill` runs it over the prompt and
the root; `commit` over the tokens that follow each accepted node (the next accepted node's token, then the
bonus, which is the next root: `accepted_tokens`), committing `n_accepted`. A node of depth d then sits at
`lengths + d - 1` of its cache, which is `FeatureDrafting`'s convention (`feature_drafting.py`): each depth's nodes run
through the model in one call and see the committed cache, their ancestors' keys/values of this step
(scratch) and themselves. Chains are static trees of one child per node; static trees give each node the rank
the tree says among its parent's drafts; a `TreeBudget` grows an EAGLE-2 dynamic tree from its log-probs.

Drafts are deterministic top-k (`q = None`) by default; with `temperature > 0` (static trees) every child is an
independent draw from its parent's draft distribution at that temperature and the proposal carries those
distributions as `q`, the classic speculative-sampling draft. Both are lossless under greedy and rejection
sampling alike. With `p_min > 0` a static tree is drafted only below nodes where the draft is sure (its most
likely next token at least that probable), and a depth where no node is skips its forward: a long chain costs few
forwards where the text is hard to guess (`FeatureDrafting.static`).

Trained here (`config` None, `amphista-jax train` with `method: draft_model`): a target with no smaller sibling
on hand (SmolLM2-135M is its family's smallest) gets one made from itself, as self-speculative drafters do
(Draft & Verify, LayerSkip): the target's embedding, its first `layers` decoder layers, its final norm and
vocabulary projection, then trained as a whole on the heads' data, distilled from the target's next-token
distribution (the target frozen; its hidden states may come from the heads' store). With a `draft_vocab` it
scores only those tokens' rows of its projection, which cuts each drafted depth's read of a large vocabulary as
for the heads (`draft_vocab.py`). With `weights="int8"` it drafts from int8 copies of its decoder projections and
vocabulary projection, one scale per output row (`projections.int8_rows`): a quarter of the bytes each drafted token
reads, made once at load (`kept_params`) or per generation (`decode_params`); on the CPU their products run in
`pallas_kernels/int8_rows.cc`'s kernel where it builds, and `weights="auto"` takes int8 exactly there. The draft's
weights only change which tokens it proposes (its acceptance), never the output: the target verifies every one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from amphista_jax.drafters.base import (
    DraftContext,
    Drafter,
    LogicalInit,
    PrefillContext,
    Proposal,
    accepted_hidden,
    accepted_tokens,
)
from amphista_jax.drafters.causal_layers import run_and_commit
from amphista_jax.drafters.draft_vocab import check_fits, normalise_field
from amphista_jax.drafters.feature_drafting import FeatureDrafting
from amphista_jax.drafters.losses import head_losses
from amphista_jax.infra import config_io
from amphista_jax.infra.errors import UserError
from amphista_jax.infra.ranges import setting
from amphista_jax.models.cache import KVCache
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.hf import load_config, load_params
from amphista_jax.models.llama import Output, PrefixKV, Transformer, param_shapes, target_model
from amphista_jax.models.projections import int8_kernel, int8_projections, rows_product
from amphista_jax.models.target import Target
from amphista_jax.models.tokenizer import load_tokenizer
from amphista_jax.trees.tree import Tree, TreeBudget, TreeError, TreeSpec
from amphista_jax.trees.verify import Verdict


class DraftModelError(UserError, ValueError):
    """A draft model that cannot draft for this target, with what to change."""


@Drafter.register
@dataclasses.dataclass(frozen=True)
class DraftModel(LogicalInit):
    name = "draft_model"
    tree_kinds = (TreeSpec, TreeBudget)
    paper_tree = "chain-4"  # what `--tree auto` means for a draft model without acceptance statistics
    # the draft model's own architecture (a loaded checkpoint); None: the target's, cut to its first `layers`
    config: ModelConfig | None = None
    # 0: top-k drafts (`q = None`); > 0 (static trees): independent draws from its distribution at this
    # temperature, passed to verification as `q` (classic speculative sampling draws at the target's temperature)
    temperature: float = setting(0.0, ge=0, why="0 = top-k drafts")
    # > 0 (static trees): a node's children are drafted only where the distribution they are drawn from gives its
    # most likely token at least this probability (llama.cpp's `p_min`; `FeatureDrafting.static`); 0: always
    p_min: float = setting(0.0, ge=0, lt=1, why="0 = draft every node of the tree")
    layers: int = setting(2, ge=1)  # without `config`: how many of the target's decoder layers it starts from
    draft_vocab: tuple[int, ...] = ()  # the candidates' target ids (draft_vocab.py); () = the whole vocabulary
    # how decoding holds its projections: "float32" as loaded, "int8" with a scale per output row, or "auto": int8
    # where this machine has the CPU kernel of int8 products (`projections.int8_kernel`), float32 elsewhere (`WEIGHTS`)
    weights: str = "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weights not in WEIGHTS:
            raise DraftModelError(f"draft_model weights={self.weights!r}: choose one of {', '.join(WEIGHTS)}")
        if self.weights == "auto":
            object.__setattr__(self, "weights", "int8" if int8_kernel() is not None else "float32")
        if isinstance(self.config, dict):  # read back from draft.json
            object.__setattr__(self, "config", config_io.from_dict(ModelConfig, self.config, "draft_model config"))
        if not isinstance(self.config, ModelConfig | None):
            raise ValueError(f"draft_model config={self.config!r} must be a model's config (omit it to make the "
                             "draft model from the target's first `layers` layers)")
        normalise_field(self)
        if self.config is not None:  # made from the target: `init_boxed` checks it against the target's
            check_fits(self.draft_vocab, self.config.vocab_size)

    @property
    def reads_labels(self) -> bool:
        return False  # trained by distillation: the CE to the target's distribution

    def arch(self, target: ModelConfig) -> ModelConfig:
        """The draft model's architecture: its own `config`, else the target's first `layers` layers (a
        `DraftModelError` naming the fix when the target has fewer)."""
        if self.config is not None:
            return self.config
        if self.layers > target.num_layers:
            raise DraftModelError(f"draft_model layers={self.layers} but the target has {target.num_layers} "
                                  f"layers: set layers to at most {target.num_layers} (a few, to draft cheaply)")
        return dataclasses.replace(target, num_layers=self.layers,
                                   sliding_windows=target.sliding_windows[: self.layers])

    def sampling_at(self, temperature: float, tree: Tree) -> DraftModel:
        """The drafter for decoding at `temperature` on `tree`: classic speculative sampling (drafts drawn at the
        target's temperature, `q` passed) on a static tree at `temperature > 0`, top-k drafts otherwise (greedy
        decoding, or an EAGLE-2 dynamic tree, which keeps the top drafts)."""
        return dataclasses.replace(self, temperature=temperature if isinstance(tree, TreeSpec) else 0.0)

    @classmethod
    def from_pretrained(cls, path: str | Path, target: ModelConfig, target_dir: str | Path | None = None,
                        dtype: str = "float32") -> tuple[DraftModel, dict]:
        """(drafter, params) of a Hugging Face checkpoint directory. Refuses one whose vocabulary differs from the
        target's (drafts are token ids: both models must mean the same thing by each): its size, and, when both
        directories hold a tokenizer, the token -> id map itself."""
        config = load_config(path)
        check_vocabularies(config, target, str(path))
        if target_dir is not None and _has_tokenizer(path) and _has_tokenizer(target_dir):
            if load_tokenizer(path).get_vocab() != load_tokenizer(target_dir).get_vocab():
                raise DraftModelError(f"{path}'s tokenizer maps tokens to ids differently from the target's "
                                      f"({target_dir}): a draft model must use the target's tokenizer")
        params, config = load_params(path, dtype=dtype, layout="split")  # decoding's layout (`split_layers`)
        return cls(config), params

    def _model(self, params: dict, target: ModelConfig) -> Transformer:
        return target_model(self.arch(target), params)

    def param_trees(self, target: Target) -> tuple[Any, ...]:
        """Decoding's (split) layout, as loaded and as `kept_params` keeps it, and the checkpoint's stacked one:
        `target_model` reads each."""
        arch = self.arch(target.config)
        split = param_shapes(arch, split=True)[0]
        kept = (jax.eval_shape(self.kept_params, split),) if self.weights == "int8" else ()
        return (split, *kept, param_shapes(arch)[0])

    def kept_params(self, params: dict) -> dict:
        """With int8 `weights`, its decoder and vocabulary projections as `int8_rows` (made once, at load; the
        embedding stays as loaded, a row read per token); as they are otherwise."""
        return int8_projections(params) if self.weights == "int8" else params

    def init_boxed(self, rng: jax.Array, target: Target) -> dict:
        """Its weights in decoding's layout: with its own `config`, random (tests; real use loads a checkpoint:
        `from_pretrained`); else the target's embedding, first `layers` layers, final norm and projection."""
        arch = self.arch(target.config)
        check_vocabularies(arch, target.config, "the draft model")
        check_fits(self.draft_vocab, target.config.vocab_size)
        tokens = jnp.zeros((1, 1), jnp.int32)

        def random(rng: jax.Array) -> dict:
            return Transformer(arch, split=True).init(rng, tokens, tokens)["params"]

        if self.config is not None:
            return random(rng)

        def copy(box: Any, weight: jax.Array) -> Any:
            weight = jnp.array(weight, jnp.float32, copy=True)  # own fp32 buffers: trained, donated
            return box.replace_boxed(weight) if isinstance(box, nn.Partitioned) else weight

        # the boxes (logical axes) of the architecture, filled with the target's weights
        return jax.tree.map(copy, jax.eval_shape(random, rng), target.first_layers(self.layers),
                            is_leaf=lambda x: isinstance(x, nn.Partitioned))

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> dict:
        c = self.arch(target_config)
        # One slot more than the target's: this cache runs one token ahead (the root).
        return {"base": jnp.zeros((batch, c.hidden_size), jnp.float32),
                "caches": (KVCache.zeros(c.num_layers, batch, cache_size + 1, c.num_kv_heads, c.head_dim),)}

    def _advance(self, params: dict, target: Target, tokens: jax.Array, count: jax.Array, state: dict) -> dict:
        """Run the model over `tokens [B, T]` at its cache's next slots, commit `count [B]` of them, and keep its
        output at the last one (the next root's: its children's draft distribution)."""
        def run(positions: jax.Array, caches: tuple[KVCache, ...]) -> tuple[jax.Array, tuple[KVCache, ...]]:
            out = self._model(params, target.config).apply({"params": params}, tokens, positions, caches[0],
                                                           return_logits=False)
            return out.hidden.astype(jnp.float32), (out.cache,)

        base, caches = run_and_commit(run, state["caches"], tokens.shape[1], count)
        return {"base": base, "caches": caches}

    def prefill(self, params: dict, target: Target, prompt: PrefillContext, state: dict) -> dict:
        b = prompt.prompt.shape[0]
        tokens = jnp.concatenate([prompt.prompt, jnp.zeros((b, 1), prompt.prompt.dtype)], axis=1)  # [B, T + 1]
        tokens = tokens.at[jnp.arange(b), prompt.lengths].set(prompt.root)  # the prompt, then the root
        return self._advance(params, target, tokens, prompt.lengths + 1, state)

    def commit(self, params: dict, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: dict) -> tuple[dict, jax.Array]:
        state = self._advance(params, target, accepted_tokens(proposal, verdict), verdict.n_accepted, state)
        return state, accepted_hidden(verdict, verify_out)

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        draft = FeatureDrafting(self, params, target, ctx)
        if isinstance(tree, TreeBudget):
            if self.temperature > 0:
                raise TreeError(f"a dynamic tree ({tree}) keeps the top drafts, not samples: use a static tree with "
                                "a sampling draft model, or temperature 0")
            return draft.dynamic(tree)
        return draft.static(tree, rng, self.temperature, self.p_min)

    def run_nodes(self, params: dict, target: Target, tokens: jax.Array, parent_features: jax.Array,
                  positions: jax.Array, cache: KVCache, new_mask: jax.Array,
                  prefix: PrefixKV | None) -> tuple[jax.Array, KVCache, None]:
        """`FeatureDrafting`'s expansion: nodes `tokens [B, M]` through the model (their parents reach them through
        the scratch keys/values) -> (final-norm hidden states `[B, M, D]`, the cache with theirs written, None)."""
        out = self._model(params, target.config).apply({"params": params}, tokens, positions, cache, new_mask,
                                                       return_logits=False, prefix=prefix)
        return out.hidden.astype(jnp.float32), out.cache, None

    def logprobs(self, params: dict, target: Target, hidden: jax.Array) -> jax.Array:
        """Draft log-probabilities `[..., V_d]` of the model's final-norm hidden states `[..., D]`."""
        return jax.nn.log_softmax(self._logits(params, hidden), axis=-1)

    def decode_params(self, params: dict, target: Target) -> dict:
        """Decoding-layout params as one generation reads them: with a draft vocabulary, its projection's rows cut
        once per generation (`draft_lm_head`, out-major `[V_d, D]`): each drafted depth then reads `V_d x D`
        weights, not the whole projection and a gather of it; with int8 `weights`, the decoder and vocabulary
        projections as `int8_rows` (as `kept_params` made them at load, else made here)."""
        if not self.draft_vocab and self.weights == "float32":
            return params
        body = {k: v for k, v in params.items() if k != "lm_head"}  # the head is read as `draft_lm_head`
        return self.kept_params(body | {"draft_lm_head": self._vocabulary_rows(params)})

    def _vocabulary_rows(self, params: dict) -> dict:
        """Its vocabulary projection out-major at the draft vocabulary's rows, `{"weight": [V_d, D]}` (with its
        `weight_scale [V_d]` where int8), from params in either layout (the tied embedding where there is no
        `lm_head`). The rows of a quantized projection are those rows' quantization."""
        head = params.get("lm_head", {"weight": params["embed"]["embedding"]})
        if "kernel" in head:  # the stacked layout's [D, V]
            head = {"weight": head["kernel"].T}
        if not self.draft_vocab:
            return head
        check_fits(self.draft_vocab, head["weight"].shape[0])
        ids = jnp.asarray(self.draft_vocab)
        return {k: v[ids] for k, v in head.items()}

    def _logits(self, params: dict, hidden: jax.Array) -> jax.Array:
        """`[..., V_d]` its own vocabulary projection of `hidden [..., D]`, at the draft vocabulary's rows (cut by
        `decode_params` once per generation when decoding, here when training)."""
        head = params.get("draft_lm_head") or self._vocabulary_rows(params)
        return rows_product(head["weight"], hidden.astype(jnp.float32), head.get("weight_scale"))

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output | None) -> tuple[jax.Array, dict]:
        """Its depth-1 drafts scored like a head's (`head0/...`: at position t, the token t + 2, read from its own
        output at t + 1, the root): the CE against the target's next-token distribution at t + 1 (distillation,
        over the draft vocabulary; `head0/distill`), its CE on `batch`'s tokens reported beside it; without
        `target_out` (scoring a checkpoint's drafts alone), that CE."""
        tokens = batch["tokens"]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        hidden = self._model(params, target.config).apply({"params": params}, tokens, positions,
                                                          return_logits=False).hidden  # [B, T, D]: token t + 1
        logits = self._logits(params, jnp.roll(hidden, -1, axis=1))[:, :, None]  # [B, T, 1, V_d]: token t + 2
        teacher = None if target_out is None else target_out.logits
        return head_losses(logits, batch, [float(teacher is None)], teacher, 1.0, teacher_name="distill",
                           draft_vocab=self.draft_vocab)


WEIGHTS = ("float32", "int8", "auto")  # `DraftModel.weights`


def _has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def check_vocabularies(draft: ModelConfig, target: ModelConfig, name: str) -> None:
    if draft.vocab_size != target.vocab_size:
        raise DraftModelError(f"{name} has a vocabulary of {draft.vocab_size} tokens but the target has "
                              f"{target.vocab_size}: a draft model must use the target's tokenizer (pick one of "
                              "the target's family, or pre-train one with the target's tokenizer)")

