"""The Python API: load a target (and a drafter) once, then generate from Python with compiled programs.

    from amphista_jax import Generator

    gen = Generator.load(heads="hydra")                  # the embedded model and its shipped Hydra heads
    ar = Generator.load()                                # the same model, autoregressive ...
    eagle = ar.with_drafter("eagle", tree="chain-4")     # ... and a drafter attached to its loaded weights
    out = gen.generate(["def fib(n):", "import os\\n"], max_new_tokens=32)
    out.texts, out.tau, out.tokens_per_s                 # completions, tokens per target forward, speed
    for piece in gen.stream("def add(a, b):"):           # text as it is committed
        print(piece, end="")

`Generator` is the only way in: the CLI, the demo, tree search, evaluation and the benchmarks build theirs with
`load` and `with_drafter` (weights in hand through `LoadedTarget.from_params`) and never assemble one by hand. It
composes three parts: the loaded target (`facade/target.py`: weights, tokenizer, stop ids, mesh and the one cache of
compiled programs), a drafter attachment (`facade/attachment.py`: its source, params and tree plan) and the view
itself, which owns what every front-end needs: tokenisation with the chat template for messages, stop ids,
right-padding into prompt-length buckets (so calls of other lengths reuse the compiled program of their bucket),
caches of the size each call's `DecodeSpec` asks for, the tree checked against the drafter and the target before
anything compiles, and streaming. Errors a caller can cause are typed (`GeneratorError` and the project's other
`UserError`s) with one-line messages that name the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from amphista_jax.choice.calibration import calibrate
from amphista_jax.choice.plan import TreePlan
from amphista_jax.drafters import Drafter
from amphista_jax.engine.decode import ARState, GenerateOutput, SpecState, advance, pad_prompts, start
from amphista_jax.engine.decode_spec import GREEDY, DecodeSpec, bucket
from amphista_jax.engine.prompt_checks import check_decode_inputs
from amphista_jax.facade.attachment import Attachment
from amphista_jax.facade.drafter_source import DrafterSource, choose_tree, read_source
from amphista_jax.facade.target import LoadedTarget
from amphista_jax.infra.errors import GeneratorError
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.fetch import resolve_model
from amphista_jax.trees.names import AUTO
from amphista_jax.trees.sampling import SamplingConfig
from amphista_jax.trees.tree import Tree
from amphista_jax.trees.verify import AcceptanceConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Generation", "Generator", "GeneratorError"]

Prompt = str | Sequence[dict[str, str]] | Sequence[int]  # text, chat messages, or token ids


@dataclasses.dataclass(frozen=True)
class Generation:
    """The results of one `Generator.generate` call, one entry per prompt."""

    texts: list[str] | None  # the completions (special tokens dropped); None without a tokenizer (ids only)
    token_ids: list[list[int]]  # the generated ids, a stop token included
    tau: list[float]  # tokens committed per decoding forward (the prefill's token not counted); 1.0 for AR
    stop_reasons: list[str]  # "eos" (a stop token) or "length" (max_new_tokens)
    drafted: list[list[bool]]  # which tokens came from accepted drafts
    seconds: float  # wall time of the compiled program (compiling excluded)
    compile_seconds: float  # time spent compiling for this call (0 when its program was cached)
    output: GenerateOutput  # the raw per-row arrays on the host (accept lengths, tree statistics)
    tree: str = "-"  # the tree decoding drafted on ("-": autoregressive decoding)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


@dataclasses.dataclass(frozen=True, eq=False)
class Generator:
    """A view of a loaded target (`LoadedTarget`), optionally with a drafter attached (`Attachment`), decoding on one
    tree: the only way in. `Generator.load(model)` loads the target; `with_drafter(heads | method | draft model,
    tree=...)` attaches a drafter, `with_tree` puts it on another tree, `autoregressive()` drops it and
    `for_batch(b)` gives the view at `b` rows; each is a new view sharing the target's weights and its one program
    cache (`Generator.load(model, heads, tree)` is both steps in one call; `Generator.load(LoadedTarget.from_params(
    config, params))` starts from weights in hand). Views are made here only."""

    target: LoadedTarget
    attachment: Attachment | None = None  # None: autoregressive
    tree: Tree | None = None  # the tree this view decodes on (None: autoregressive)
    tree_name: str = "-"
    notes: tuple[str, ...] = ()  # what `load` / `with_drafter` chose for you, and why
    batch: int | None = None  # the batch size `for_batch` made this view for (its tree fixed); None: per call

    @classmethod
    def load(cls, model: str | Path | LoadedTarget | None = None,
             heads: str | Path | Drafter | DrafterSource | None = None, tree: str | Tree = AUTO, *,
             dtype: str = "float32", mesh: jax.sharding.Mesh | None = None, attention: str = "xla",
             draft_model: str | Path | None = None, settings: dict[str, Any] | None = None,
             seed: int = 0) -> Generator:
        """Load the target `model` (a Hugging Face directory, a fetched name such as `smollm2`, None for the
        embedded default, or a `LoadedTarget` already in hand) in the decode layout, then attach `heads` or
        `draft_model` (a directory or a fetched name) with its decoding `settings` changed as `with_drafter` does
        (None: autoregressive; a `DrafterSource`: a source read already). The drafter and its tree are read and
        checked before any weights load."""
        from amphista_jax.models.hf import load_config

        if heads is not None and draft_model is not None:
            raise GeneratorError("give heads or draft_model, not both: a draft model drafts on its own")
        loaded = model if isinstance(model, LoadedTarget) else None
        model_dir = loaded.model_dir if loaded else resolve_model(None if model is None else str(model))
        config = loaded.config if loaded else load_config(model_dir)
        source = heads if draft_model is None else Path(draft_model)  # a directory or a fetched model's name
        found, plan = None, None
        if source is not None:
            found = source if isinstance(source, DrafterSource) else read_source(source, model_dir or None, config,
                                                                                 settings)
            plan = choose_tree(tree, found, config.vocab_size)
        target = loaded or LoadedTarget.load(model_dir, config, dtype=dtype, mesh=mesh, attention=attention)
        gen = cls(target)
        return gen if found is None else gen._attach(found, plan, seed)

    def with_drafter(self, source: str | Path | Drafter | DrafterSource, tree: str | Tree | TreePlan = AUTO, *,
                     settings: dict[str, Any] | None = None, draft_params: Any = None, seed: int = 0) -> Generator:
        """This target with a drafter (`drafter_source.read_source`): a draft-head directory, a method name (its
        heads shipped for this target, else untrained), `<method>:untrained`, a draft model's directory, or a
        `Drafter` with its `draft_params` (None: initialised with `seed`); `settings` change its decoding
        settings. `tree` as `drafter_source.choose_tree` reads it: a name (`auto`: chosen on this machine, per
        batch size, from the acceptance statistics shipped with the heads, else their paper's tree), a JSON file of
        paths, a tree search's policy file, a `TreeSpec` / `TreeBudget`. Drafter and tree are checked against the
        target before any params load; the new view shares this one's target."""
        found = source if isinstance(source, DrafterSource) else read_source(
            source, self.model_dir or None, self.config, settings, draft_params)
        return self._attach(found, choose_tree(tree, found, self.config.vocab_size), seed)

    def _attach(self, source: DrafterSource, plan: TreePlan, seed: int) -> Generator:
        attachment = Attachment.attach(self.target, source, plan, seed)
        return self._on(attachment, (source.note,) if source.note else ())

    def _on(self, attachment: Attachment, notes: tuple[str, ...]) -> Generator:
        """The view of `attachment` on its plan's tree, with `notes` and the plan's; a plan chosen here (`auto` with
        acceptance statistics) is first priced by this machine's step costs (`calibration.calibrate`: at batch 1
        now, at other batch sizes on first use), timed on the attachment's views."""
        plan = attachment.plan
        notes = (*notes, plan.note) if plan.note else notes
        if not plan.chooses_here:
            return Generator(self.target, attachment, plan.tree, plan.name, notes)
        unpriced = Generator(self.target, attachment, plan.tree, plan.name, notes)
        stats = plan.acceptance
        attachment = attachment.on_plan(plan.priced(lambda batch: calibrate(unpriced, stats, batch)))
        plan = attachment.plan
        return Generator(self.target, attachment, plan.at(1), plan.label(1), (*notes, plan.describe(1)))

    # -- what this view is ------------------------------------------------------------------------------------

    @property
    def config(self) -> ModelConfig:
        return self.target.config

    @property
    def params(self) -> dict:
        return self.target.params

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.target.tokenizer

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.target.eos_ids

    @property
    def model_dir(self) -> str:
        return self.target.model_dir

    @property
    def attention(self) -> str:
        return self.target.attention

    @property
    def mesh(self) -> jax.sharding.Mesh | None:
        return self.target.mesh

    @property
    def dtype(self) -> str:
        """The target's parameter dtype (`float32`, `bfloat16`)."""
        return self.target.dtype

    @property
    def pad_id(self) -> int:
        return self.target.pad_id

    @property
    def drafter(self) -> Drafter | None:
        return None if self.attachment is None else self.attachment.drafter

    @property
    def draft_params(self) -> Any:
        return None if self.attachment is None else self.attachment.params

    @property
    def method(self) -> str:
        return "ar" if self.attachment is None else self.attachment.method

    @property
    def heads_dir(self) -> str | None:
        return None if self.attachment is None else self.attachment.heads_dir

    @property
    def acceptance(self) -> Path | None:
        """The drafter's acceptance statistics, if any (`auto` chooses from them)."""
        return None if self.attachment is None else self.attachment.acceptance

    @property
    def policy(self) -> TreePlan | None:
        """Which tree at each batch size, and why (None: autoregressive, or a `for_batch` view)."""
        return None if self.attachment is None or self.batch is not None else self.attachment.plan

    # -- other views of the same target -----------------------------------------------------------------------

    def autoregressive(self) -> Generator:
        """The plain autoregressive decoder of the same target (the baseline every speed-up is measured on)."""
        return Generator(self.target)

    def with_tree(self, tree: str | Tree) -> Generator:
        """The same target, drafter and params on another tree (`drafter_source.choose_tree`, checked against
        both)."""
        if self.attachment is None:
            raise GeneratorError("autoregressive decoding has no tree: load heads or a draft model")
        return self._on(self.attachment.on_plan(choose_tree(tree, self.attachment.source, self.config.vocab_size)),
                        ())

    def for_batch(self, batch: int) -> Generator:
        """This generator as it decodes `batch` rows: under a tree policy (`tree="auto"` chosen on this machine, or a
        policy file) the same drafter on the tree picked for that batch size, or the autoregressive decoder where
        none is predicted to beat it; without one, itself. Every view compiles into the target's one cache."""
        if isinstance(batch, bool) or not isinstance(batch, int | np.integer) or batch < 1:
            raise GeneratorError(f"for_batch({batch!r}): the batch size is a whole number of rows, at least 1")
        if self.policy is None or ((tree := self.policy.at(batch)) == self.tree and tree is not None):
            return self
        name = self.policy.label(batch)
        attachment = None if tree is None else self.attachment
        return Generator(self.target, attachment, tree, name, batch=int(batch))

    # -- prompts ----------------------------------------------------------------------------------------------

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of one prompt: text (through the chat template with `chat`), chat messages (`[{"role",
        "content"}]`, always through the template) or token ids (checked against the vocabulary)."""
        from amphista_jax.models.tokenizer import encode_conversation, encode_prompt

        if isinstance(prompt, str):
            ids = encode_prompt(self.tokenizer, prompt, chat=chat)
        elif len(prompt) and all(isinstance(m, dict) for m in prompt):
            ids = encode_conversation(self.tokenizer, list(prompt))
        elif all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise GeneratorError("a prompt is a string, a list of chat messages ({'role', 'content'} dicts) or a "
                                 f"list of token ids; got {type(prompt).__name__} of {_kinds(prompt)}")
        if not ids:
            raise GeneratorError("empty prompt: every prompt needs at least one token")
        if bad := [t for t in ids if not 0 <= t < self.config.vocab_size]:
            raise GeneratorError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size}): check "
                                 "the tokenizer matches the model")
        return ids

    def _batch(self, prompts: Prompt | Sequence[Prompt], chat: bool) -> list[list[int]]:
        if not isinstance(prompts, str | Sequence):
            raise GeneratorError("prompts are a string, a list of chat messages, a list of token ids, or a list of "
                                 f"those; got {type(prompts).__name__}")
        single = isinstance(prompts, str) or (len(prompts) > 0 and not isinstance(prompts[0], str | list | tuple))
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise GeneratorError("no prompts: pass a prompt or a list of prompts")
        return [self.encode(p, chat) for p in batch]

    # -- programs ---------------------------------------------------------------------------------------------

    def spec(self, max_new_tokens: int, sampling: SamplingConfig = GREEDY, acceptance: AcceptanceConfig | None = None,
             stop_at_eos: bool = True, adapt: bool = True) -> DecodeSpec:
        """The decode spec of one call (AR when there is no drafter), checked as it is made. With `adapt`, the
        drafter as it decodes at this temperature (`Drafter.sampling_at`); without, as it is (a caller that set
        it already)."""
        drafter = self.drafter if self.tree is not None else None  # no tree (`auto` chose none): AR
        if drafter is not None and adapt:
            drafter = drafter.sampling_at(sampling.temperature, self.tree)
        return DecodeSpec(self.config, drafter, self.tree if drafter is not None else None, max_new_tokens, sampling,
                          acceptance or AcceptanceConfig(), self.eos_ids if stop_at_eos else (), self.pad_id,
                          self.attention)

    def _draft_params(self, spec: DecodeSpec) -> Any:
        return None if spec.drafter is None else self.draft_params

    def program(self, tokens: np.ndarray, lengths: np.ndarray, spec: DecodeSpec, cache_size: int | None = None
                ) -> tuple[jax.stages.Compiled, float]:
        """(the compiled `decode` program for the shape of `tokens [B, T]`, this spec and cache size (default:
        `spec.cache_size(T)`), from the target's cache; seconds spent compiling it now: 0 when cached). Call it as
        `program(params, draft_params or None, tokens, lengths, rng)` (`run`)."""
        return self.target.program(tokens, lengths, spec, self._draft_params(spec),
                                   cache_size or spec.cache_size(tokens.shape[1]))

    def release_programs(self) -> None:
        """Drop the programs compiled on this generator's target, by every view of it (`LoadedTarget.
        release_programs`)."""
        self.target.release_programs()

    def run(self, tokens: np.ndarray, lengths: np.ndarray, spec: DecodeSpec, rng: jax.Array | int = 0,
            cache_size: int | None = None) -> tuple[GenerateOutput, float, float]:
        """Decode right-padded `tokens [B, T]` of `lengths [B]` with the compiled program of their shape: (output
        on the host, seconds, compile seconds). `generate` pads and buckets first; evaluation calls this with its
        own padding. `rng`: a key, or the seed of one; `cache_size`: see `program`."""
        check_decode_inputs(spec, self.params, self._draft_params(spec), tokens, lengths)
        compiled, compile_s = self.program(tokens, lengths, spec, cache_size)
        rng = jax.random.key(rng) if isinstance(rng, int) else rng
        with self.on_mesh():
            t0 = time.perf_counter()
            out = jax.block_until_ready(compiled(self.params, self._draft_params(spec), tokens, lengths, rng))
            seconds = time.perf_counter() - t0
        return jax.device_get(out), seconds, compile_s

    def on_mesh(self) -> contextlib.AbstractContextManager:
        return self.target.on_mesh()

    # -- generation -------------------------------------------------------------------------------------------

    def _request(self, ids: list[list[int]], max_new_tokens: int, sampling: SamplingConfig,
                 acceptance: AcceptanceConfig | None, stop_at_eos: bool
                 ) -> tuple[Generator, DecodeSpec, np.ndarray, np.ndarray]:
        """What one call decodes, as `generate` and `stream` alike prepare it from the prompts' ids: (the generator
        at this batch size, the call's spec, the prompts right-padded into their bucket `[B, T]`, their lengths
        `[B]`)."""
        gen = self.for_batch(len(ids))
        spec = gen.spec(max_new_tokens, sampling, acceptance, stop_at_eos)
        tokens, lengths = pad_prompts(ids, length=bucket(max(len(i) for i in ids)), pad_id=self.pad_id)
        return gen, spec, tokens, lengths

    def generate(self, prompts: Prompt | Sequence[Prompt], *, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = False,
                 acceptance: AcceptanceConfig | None = None, stop_at_eos: bool = True,
                 cache_size: int | None = None) -> Generation:
        """Complete one prompt or a batch (text, chat messages or token ids; `chat` puts text through the chat
        template too): greedy at `temperature` 0, else sampled (lossless rejection sampling by default). Rows stop
        at a stop token (unless `stop_at_eos` is False) or after `max_new_tokens`. `cache_size` overrides the
        cache's slots (default: `DecodeSpec.cache_size` of the prompt bucket)."""
        gen, spec, tokens, lengths = self._request(self._batch(prompts, chat), max_new_tokens,
                                                   SamplingConfig(temperature, top_k, top_p), acceptance, stop_at_eos)
        out, seconds, compile_s = gen.run(tokens, lengths, spec, seed, cache_size)
        generation = gen._generation(out, seconds, compile_s, spec.eos_ids)
        if self.policy is not None and self.policy.chooses_here:  # why `auto` chose this tree here at this batch size
            return dataclasses.replace(generation, tree=self.policy.describe(len(tokens)))
        return generation

    def _generation(self, out: GenerateOutput, seconds: float, compile_s: float, eos_ids: tuple[int, ...]
                    ) -> Generation:
        rows = range(out.tokens.shape[0])
        ids = [[int(t) for t in out.tokens[r, : int(out.num_tokens[r])]] for r in rows]
        return Generation(
            texts=None if self.tokenizer is None else [self.tokenizer.decode(i, skip_special_tokens=True) for i in ids],
            token_ids=ids,
            tau=[float(t) for t in out.tau], stop_reasons=["eos" if i and i[-1] in eos_ids else "length" for i in ids],
            drafted=[[bool(d) for d in out.drafted[r, : len(ids[r])]] for r in rows], seconds=seconds,
            compile_seconds=compile_s, output=out, tree=self.tree_name)

    def stream(self, prompt: Prompt, *, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, chat: bool = False, acceptance: AcceptanceConfig | None = None,
               steps_per_chunk: int = 4) -> Iterator[str]:
        """Yield the completion of one prompt as text pieces, as decoding commits them: `generate`'s decode (the same
        request, spec, cache, steps and keys, so the same tokens), run `steps_per_chunk` jitted steps at a time."""
        if steps_per_chunk < 1:
            raise GeneratorError(f"steps_per_chunk={steps_per_chunk}: must be >= 1")
        gen, spec, tokens, lengths = self._request([self.encode(prompt, chat)], max_new_tokens,
                                                   SamplingConfig(temperature, top_k, top_p), acceptance, True)
        draft_params, state = gen.start(tokens, lengths, spec, seed)
        shown = ""
        while True:
            n, done = int(state.num_tokens[0]), bool(state.done[0])
            text = self.tokenizer.decode(np.asarray(state.tokens[0, :n]), skip_special_tokens=True)
            # whole characters only, and only text that extends what was shown (a tokenizer may rewrite a tail)
            if len(text) > len(shown) and text.startswith(shown) and (done or not text.endswith("\ufffd")):
                yield text[len(shown):]
                shown = text
            if done:
                return
            state = gen.advance(draft_params, state, spec, steps_per_chunk)

    def start(self, tokens: np.ndarray, lengths: np.ndarray, spec: DecodeSpec, rng: jax.Array | int = 0,
              cache_size: int | None = None) -> tuple[Any, ARState | SpecState]:
        """`run`'s decode up to its first token, to be `advance`d in chunks: (the drafter's params in its decode
        layout, made once for every chunk; the state after the prefill), on `run`'s checks and cache
        (`cache_size`, default `spec.cache_size(T)`)."""
        check_decode_inputs(spec, self.params, self._draft_params(spec), tokens, lengths)
        rng = jax.random.key(rng) if isinstance(rng, int) else rng
        with self.on_mesh():
            draft_params = None if spec.drafter is None else jax.jit(spec.drafter.decode_params)(
                self.draft_params, self.target.view)
            return draft_params, start(self.params, draft_params, tokens, lengths, rng, spec=spec,
                                       cache_size=cache_size or spec.cache_size(tokens.shape[1]))

    def advance(self, draft_params: Any, state: ARState | SpecState, spec: DecodeSpec, steps: int
                ) -> ARState | SpecState:
        """Up to `steps` more decode steps of a `start`ed state (`decode.advance`: `state` is donated, use the one
        returned), fewer once every row is done."""
        with self.on_mesh():
            return advance(self.params, draft_params, state, spec=spec, steps=steps)


def _kinds(items: Any) -> str:
    return ", ".join(sorted({type(x).__name__ for x in items})) if isinstance(items, Sequence) else "?"


def print_notes(gen: Generator) -> None:
    """The CLI's way of saying what `load` chose: each note on stderr."""
    for note in gen.notes:
        print(f"note: {note}", file=sys.stderr)
