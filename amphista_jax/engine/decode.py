"""Generation: prefill, then a `lax.while_loop` of steps, all inside one `jax.jit` with static shapes.

`decode` is the one entry: its static argument is a `DecodeSpec` (decode_spec.py), and its `init` and `step`
cover autoregressive decoding (no drafter: `ar_init`, `ar_step`, the baseline every speed-up is measured
against) and speculative decoding (`spec_init`: prefill of the target and the drafter; `spec_step`: propose,
verify, accept, compact, commit, emit) until every row is done. `generate` and `speculative_generate` are thin
wrappers that make the spec from keywords; `start` / `advance` run the same steps in chunks (streaming).
Shapes are fixed by (batch, prompt_len, cache_size, max_new_tokens) and, for speculative decoding, the tree budget
(N nodes, depth D): a tree's content (its tokens and, for drafters that build trees on device, its shape) is data,
so a new batch of prompts of the same padded shape reuses the compiled program. Rows of a batch have their own
prompt lengths (`prompt_lengths [B]`): the prompts are right-padded and each row continues from its own length, with
no re-padding.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from amphista_jax.drafters.base import DraftContext, Drafter, PrefillContext, Proposal, accepted_tokens
from amphista_jax.engine.decode_spec import DEFAULT_ACCEPTANCE, GREEDY, DecodeSpec
from amphista_jax.engine.prompt_checks import HostChecked, PromptTooLongError
from amphista_jax.infra.errors import DecodeSpecError
from amphista_jax.models.attention import causal_mask
from amphista_jax.models.cache import KVCache, compact, constrain_caches
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output, Transformer, new_cache
from amphista_jax.models.target import Extras, Target, forward
from amphista_jax.trees.sampling import SamplingConfig, select_token
from amphista_jax.trees.tree import Tree, tree_statistics
from amphista_jax.trees.verify import AcceptanceConfig, Verdict, verify


@struct.dataclass
class GenerateOutput:
    tokens: jax.Array  # [B, max_new_tokens] generated tokens, `pad_id` after a row stops
    num_tokens: jax.Array  # [B] tokens generated per row (an EOS token counts and is included)
    steps: jax.Array  # [] target forward passes after the prefill
    accept_lengths: jax.Array  # [B, max_new_tokens] tokens committed by each forward (0 once a row is done)
    drafted: jax.Array  # [B, max_new_tokens] bool, the token came from the drafter (accepted draft)
    # Speculative decoding only (None for AR), summed over steps: `[B, D, R]` how often the tree node at depth
    # d + 1 holding its head's rank-r candidate had its parent on the accepted path (tried), and how often it
    # was itself accepted (hit). hit / tried = P(rank r is the target's token at depth d + 1 | path accepted).
    node_tries: jax.Array | None = None
    node_hits: jax.Array | None = None

    @property
    def row_steps(self) -> np.ndarray:
        """`[B]` target forwards after the prefill that committed tokens to each row (a row stops counting once it
        is done)."""
        return (np.asarray(self.accept_lengths) > 0).sum(1)

    @property
    def tau(self) -> np.ndarray:
        """`[B]` tokens committed per decoding forward, each row's own: (its new tokens - the prefill's one) / its
        steps; 1.0 for a row the prefill finished."""
        steps, new = self.row_steps, np.asarray(self.num_tokens)
        return np.where(steps > 0, (new - 1) / np.maximum(steps, 1), 1.0)


@struct.dataclass
class ARState:
    """Everything one autoregressive step reads and writes (the `while_loop` carry of `generate`)."""

    cache: KVCache
    last: jax.Array  # [B] the token to feed next
    tokens: jax.Array  # [B, max_new_tokens]
    num_tokens: jax.Array  # [B]
    done: jax.Array  # [B] bool
    steps: jax.Array  # []
    rng: jax.Array


def pad_prompts(prompts: Sequence[Sequence[int]], length: int | None = None, pad_id: int = 0,
                multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to `[B, length]` (default: the longest, rounded up to `multiple` so that
    similar batches share one compiled program). Returns (tokens [B, T] int32, lengths [B] int32)."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise PromptTooLongError("empty prompt: every prompt needs at least one token (e.g. BOS)")
    longest = int(lengths.max())
    length = length or -(-longest // multiple) * multiple
    if longest > length:
        raise PromptTooLongError(f"prompt of {longest} tokens does not fit the padded length {length}")
    out = np.full((len(prompts), length), pad_id, np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, lengths


def prefill(
    model: Transformer, params: dict, prompt: jax.Array, prompt_lengths: jax.Array, cache: KVCache,
    extras: Extras | None = None, captures: tuple[int, ...] = (),
) -> tuple[Output, KVCache, jax.Array, jax.Array]:
    """Run the padded prompts `[B, T]` (and a drafter's prefill `extras`) through the model; commit each
    row's own length. `captures`: the layers whose inputs the output keeps (`Output.captured`).

    Returns (output over all prompt slots, then the extras', committed cache, hidden state `[B, D]` and fp32
    logits `[B, V]` at each row's last prompt token).
    """
    b, t = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = forward(model, params, prompt, positions, cache, causal_mask(b, t), extras, False, captures)
    last_hidden = jnp.take_along_axis(out.hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, D]
    logits = model.apply({"params": params}, last_hidden, method=Transformer.logits)
    cache = out.cache.replace(lengths=prompt_lengths.astype(jnp.int32))
    return out, cache, last_hidden, logits


def _check_static_fit(spec: DecodeSpec, prompt_len: int, cache_size: int) -> None:
    """Trace-time guard: every cache write must land inside the cache (XLA would otherwise clamp the write
    onto committed slots). Sized on the padded prompt length, which bounds every row's length
    (`DecodeSpec.cache_size`)."""
    if (need := spec.cache_size(prompt_len)) > cache_size:
        raise PromptTooLongError(
            f"padded prompt length {prompt_len} + max_new_tokens={spec.max_new_tokens} + {spec.scratch} scratch slots "
            f"(tree nodes and extras) = {need} cache slots, but {cache_size=}: raise the cache size (--max-len) or "
            "lower --max-new-tokens")


def is_stop(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """`[...]` bool: which tokens are one of `eos_ids`."""
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return (tokens[..., None] == jnp.asarray(eos_ids, tokens.dtype)).any(-1)


def generate(params: dict, prompt: jax.Array, prompt_lengths: jax.Array, rng: jax.Array, *, config: ModelConfig,
             max_new_tokens: int, cache_size: int, sampling: SamplingConfig = GREEDY, eos_ids: tuple[int, ...] = (),
             pad_id: int = 0, attention: str = "xla") -> GenerateOutput:
    """Autoregressive generation of up to `max_new_tokens` per row of right-padded `prompt [B, T]`; a row stops
    after an EOS token: `decode` with no drafter. Needs `cache_size >= T + max_new_tokens`. `params` in either
    layer layout (decoding loads the `split_layers` one: `hf.load_params(layout="split")`)."""
    spec = DecodeSpec(config, None, None, max_new_tokens, sampling, DEFAULT_ACCEPTANCE, eos_ids, pad_id, attention)
    return decode(params, None, prompt, prompt_lengths, rng, spec=spec, cache_size=cache_size)


def ar_init(model: Transformer, params: dict, prompt: jax.Array, prompt_lengths: jax.Array, rng: jax.Array,
            cache_size: int, max_new_tokens: int, sampling: SamplingConfig = GREEDY, eos_ids: tuple[int, ...] = (),
            pad_id: int = 0) -> ARState:
    """Prefill the right-padded prompts `[B, T]`; the first token comes from the target (`generate`'s state
    before its loop)."""
    b = prompt.shape[0]
    dtype = jax.tree.leaves(params)[0].dtype
    _, cache, _, logits = prefill(model, params, prompt, prompt_lengths,
                                  constrain_caches(new_cache(model.config, b, cache_size, dtype)))
    first = select_token(logits, jax.random.fold_in(rng, 0), sampling)
    return ARState(
        cache=cache,
        last=first,
        tokens=jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first),
        num_tokens=jnp.ones((b,), jnp.int32),
        done=is_stop(first, eos_ids) | (max_new_tokens <= 1),
        steps=jnp.zeros((), jnp.int32),
        rng=rng,
    )


def ar_step(model: Transformer, params: dict, s: ARState, sampling: SamplingConfig = GREEDY,
            eos_ids: tuple[int, ...] = (), pad_id: int = 0) -> ARState:
    """One autoregressive step (the loop body of `generate`): a one-token forward, the next token, emit, stop.
    Rows already done change nothing."""
    max_new_tokens = s.tokens.shape[1]
    out = model.apply({"params": params}, s.last[:, None], s.cache.lengths[:, None], s.cache)
    nxt = select_token(out.logits[:, 0], jax.random.fold_in(s.rng, s.steps + 1), sampling)
    nxt = jnp.where(s.done, pad_id, nxt)
    tokens = jax.vmap(lambda row, i, tok: row.at[i].set(tok, mode="drop"))(
        s.tokens, jnp.where(s.done, max_new_tokens, s.num_tokens), nxt)
    num_tokens = s.num_tokens + (~s.done)
    done = s.done | is_stop(nxt, eos_ids) | (num_tokens >= max_new_tokens)
    return ARState(out.cache.advance(~s.done), nxt, tokens, num_tokens, done, s.steps + 1, s.rng)


@struct.dataclass
class SpecState:
    """Everything one speculative step reads and writes (the `while_loop` carry)."""

    cache: KVCache
    draft_state: Any
    root: jax.Array  # [B] target's next token, not yet in the cache
    hidden: jax.Array  # [B, D] hidden state at the node that produced `root`
    tokens: jax.Array  # [B, max_new_tokens]
    drafted: jax.Array  # [B, max_new_tokens] bool
    num_tokens: jax.Array  # [B]
    done: jax.Array  # [B]
    accept_lengths: jax.Array  # [B, max_new_tokens] tokens committed per step (0 once done)
    node_tries: jax.Array  # [B, D * R] (GenerateOutput.node_tries, flattened)
    node_hits: jax.Array  # [B, D * R]
    steps: jax.Array  # []
    rng: jax.Array


def spec_init(params: dict, draft_params: Any, prompt: jax.Array, prompt_lengths: jax.Array, rng: jax.Array,
              cache_size: int, spec: DecodeSpec) -> SpecState:
    """Prefill the target and the drafter on the right-padded prompts `[B, T]`; the first token comes from
    the target."""
    b, t = prompt.shape
    dtype = jax.tree.leaves(params)[0].dtype
    frozen = Target(spec.config, params)
    extras = spec.drafter.prefill_extras(draft_params, frozen, prompt, prompt_lengths)
    if extras is not None and t + extras.count > cache_size:
        raise PromptTooLongError(f"padded prompt length {t} + {extras.count} prefill extras > {cache_size=}: raise "
                                 "the cache size (--max-len)")
    out, cache, hidden, logits = prefill(spec.model(params), params, prompt, prompt_lengths,
                                         constrain_caches(new_cache(spec.config, b, cache_size, dtype)), extras,
                                         spec.drafter.captured_layers(spec.config))
    first = select_token(logits, jax.random.fold_in(rng, 0), spec.sampling)
    draft_state = spec.drafter.prefill(draft_params, frozen, PrefillContext(out, prompt, prompt_lengths, first),
                                     constrain_caches(spec.drafter.init_state(spec.config, b, cache_size)))
    # The verify forward writes N + E scratch slots after the committed ones (E: the proposal's extras).
    ctx = DraftContext(hidden, first, cache.lengths, draft_state)
    shape = jax.eval_shape(lambda: spec.drafter.propose(draft_params, frozen, ctx, spec.tree, rng))
    extras = shape.extras.count if shape.extras else 0
    if spec.tree.num_nodes + extras != spec.scratch:
        raise ValueError(f"the drafter's proposals carry {extras} extras but its num_extras(tree) says "
                         f"{spec.scratch - spec.tree.num_nodes}")
    _check_static_fit(spec, t, cache_size)
    stats = _no_node_stats(b, spec)
    return SpecState(
        cache=cache, draft_state=draft_state, root=first, hidden=hidden,
        tokens=jnp.full((b, spec.max_new_tokens), spec.pad_id, jnp.int32).at[:, 0].set(first),
        drafted=jnp.zeros((b, spec.max_new_tokens), bool),
        num_tokens=jnp.ones((b,), jnp.int32),
        done=is_stop(first, spec.eos_ids) | (spec.max_new_tokens <= 1),
        accept_lengths=jnp.zeros((b, spec.max_new_tokens), jnp.int32),
        node_tries=stats, node_hits=stats, steps=jnp.zeros((), jnp.int32), rng=rng)


def _check_proposal(proposal: Proposal, tree: Tree, batch: int) -> None:
    """Trace-time: the drafter's tree fits the static budget the engine was compiled for."""
    n, d = tree.num_nodes, tree.depth
    want = {"tokens": (batch, n), "tree.mask": (batch, n, n), "tree.parent": (batch, n),
            "tree.paths": (batch, proposal.tree.paths.shape[1], d + 1)}
    got = {"tokens": proposal.tokens.shape, "tree.mask": proposal.tree.mask.shape,
           "tree.parent": proposal.tree.parent.shape, "tree.paths": proposal.tree.paths.shape}
    wrong = [f"{k} {got[k]} (want {want[k]})" for k in want if tuple(got[k]) != want[k]]
    if wrong or proposal.tree.num_ranks != tree.num_ranks:
        raise ValueError(f"the drafter's proposal does not fit the tree budget {tree}: {', '.join(wrong)}"
                         f"{'' if proposal.tree.num_ranks == tree.num_ranks else ', num_ranks differs'}")


def _step_key(s: SpecState, part: int) -> jax.Array:
    """The random key of one part of step `s.steps` (0: propose, 1: acceptance)."""
    return jax.random.fold_in(jax.random.fold_in(s.rng, s.steps + 1), part)


def spec_propose(params: dict, draft_params: Any, s: SpecState, spec: DecodeSpec) -> Proposal:
    """Step part 1: the drafter proposes each row's tree and its tokens (within the static budget)."""
    ctx = DraftContext(s.hidden, s.root, s.cache.lengths, s.draft_state)
    proposal = spec.drafter.propose(draft_params, Target(spec.config, params), ctx, spec.tree, _step_key(s, 0))
    _check_proposal(proposal, spec.tree, s.root.shape[0])
    return proposal


def spec_verify(params: dict, s: SpecState, proposal: Proposal, spec: DecodeSpec) -> tuple[Output, Verdict]:
    """Step part 2: one target forward over every node under the tree's ancestor mask (positions = length +
    depth; extras ride along), then the acceptance rule picks each row's path and bonus token."""
    tree = proposal.tree
    positions = s.cache.lengths[:, None] + tree.depth
    verified = forward(spec.model(params), params, proposal.tokens, positions, s.cache, tree.mask, proposal.extras,
                       captures=spec.drafter.captured_layers(spec.config))
    verdict = verify(proposal.tokens, verified.logits[:, :spec.tree.num_nodes], tree, spec.sampling, spec.acceptance,
                     _step_key(s, 1), proposal.q)
    return verified, verdict


def spec_commit(params: dict, draft_params: Any, s: SpecState, proposal: Proposal, verified: Output,
                verdict: Verdict, spec: DecodeSpec) -> SpecState:
    """Step part 3: compact the accepted path's keys/values into the committed cache, the drafter's commit,
    emit the path's tokens and the bonus token up to an EOS or `max_new_tokens`, and mark finished rows.
    Rows already done change nothing but stay in the batch."""
    depth = spec.tree.depth
    n_acc = jnp.where(s.done, 0, verdict.n_accepted)
    verdict = verdict.replace(n_accepted=jnp.maximum(n_acc, 1))
    cache = compact(verified.cache, verdict.accepted_nodes, n_acc)
    draft_state, hidden = spec.drafter.commit(draft_params, Target(spec.config, params), proposal, verdict, verified,
                                            s.draft_state)
    # Emitted this step: the accepted draft tokens (path nodes 1..n-1), then the bonus token.
    emit = accepted_tokens(proposal, verdict.replace(n_accepted=n_acc))  # [B, D+1]
    idx = jnp.arange(depth + 1)[None]
    stop = is_stop(emit, spec.eos_ids) & (idx < n_acc[:, None])
    hit = stop.any(1)
    first_stop = jnp.where(hit, jnp.argmax(stop, 1) + 1, depth + 1)  # tokens up to and including an EOS
    count = jnp.minimum(jnp.minimum(n_acc, first_stop), spec.max_new_tokens - s.num_tokens)
    count = jnp.where(s.done, 0, count)
    dest = jnp.where(idx < count[:, None], s.num_tokens[:, None] + idx, spec.max_new_tokens)
    scatter = jax.vmap(lambda row, d, e: row.at[d].set(e, mode="drop"))
    num_tokens = s.num_tokens + count
    # Tree-search statistics: nodes whose parent is on the accepted path were tried; on it, hit.
    tried, hits = tree_statistics(proposal.tree, verdict.accepted_nodes)
    live = (~s.done)[:, None].astype(jnp.int32)
    return SpecState(
        cache=cache, draft_state=draft_state, root=verdict.bonus, hidden=hidden,
        tokens=scatter(s.tokens, dest, emit), drafted=scatter(s.drafted, dest, idx < n_acc[:, None] - 1),
        num_tokens=num_tokens,
        done=s.done | (hit & (first_stop <= count)) | (num_tokens >= spec.max_new_tokens),
        accept_lengths=s.accept_lengths.at[:, s.steps].set(count, mode="drop"),
        node_tries=s.node_tries + tried * live, node_hits=s.node_hits + hits * live, steps=s.steps + 1, rng=s.rng)


def spec_step(params: dict, draft_params: Any, s: SpecState, spec: DecodeSpec) -> SpecState:
    """One speculative step: propose (`spec_propose`), verify forward and accept (`spec_verify`), compact,
    commit, emit and stop (`spec_commit`). Pure: the `while_loop` of `speculative_generate` only iterates it."""
    proposal = spec_propose(params, draft_params, s, spec)
    verified, verdict = spec_verify(params, s, proposal, spec)
    return spec_commit(params, draft_params, s, proposal, verified, verdict, spec)


def speculative_generate(params: dict, draft_params: Any, prompt: jax.Array, prompt_lengths: jax.Array,
                         rng: jax.Array, *, config: ModelConfig, drafter: Drafter, tree: Tree, max_new_tokens: int,
                         cache_size: int, sampling: SamplingConfig = GREEDY,
                         acceptance: AcceptanceConfig = DEFAULT_ACCEPTANCE, eos_ids: tuple[int, ...] = (),
                         pad_id: int = 0, attention: str = "xla") -> GenerateOutput:
    """Draft-tree / verify generation: `decode` with `drafter` on `tree`; greedy output equals `generate`'s token
    for token. Needs `cache_size >= spec.cache_size(T)` (`DecodeSpec.cache_size`: the prompt, the new tokens and
    the tree's scratch slots; checked at trace time)."""
    spec = DecodeSpec(config, drafter, tree, max_new_tokens, sampling, acceptance, eos_ids, pad_id, attention)
    return decode(params, draft_params, prompt, prompt_lengths, rng, spec=spec, cache_size=cache_size)


def init(params: dict, draft_params: Any, prompt: jax.Array, prompt_lengths: jax.Array, rng: jax.Array,
         cache_size: int, spec: DecodeSpec) -> ARState | SpecState:
    """The state after the prefill (the first token emitted): `ar_init` without a drafter, else `spec_init`
    (`draft_params` in the drafter's decode layout, `Drafter.decode_params`)."""
    if spec.drafter is None:
        _check_static_fit(spec, prompt.shape[1], cache_size)
        return ar_init(spec.model(params), params, prompt, prompt_lengths, rng, cache_size, spec.max_new_tokens,
                       spec.sampling, spec.eos_ids, spec.pad_id)
    return spec_init(params, draft_params, prompt, prompt_lengths, rng, cache_size, spec)


def step(params: dict, draft_params: Any, state: ARState | SpecState, spec: DecodeSpec) -> ARState | SpecState:
    """One decode step: `ar_step` without a drafter, else `spec_step`."""
    if spec.drafter is None:
        return ar_step(spec.model(params), params, state, spec.sampling, spec.eos_ids, spec.pad_id)
    return spec_step(params, draft_params, state, spec)


def output(final: ARState | SpecState, spec: DecodeSpec) -> GenerateOutput:
    """The host-facing result of a finished decode."""
    if spec.drafter is None:
        one_per_step = (jnp.arange(spec.max_new_tokens)[None] < final.num_tokens[:, None] - 1).astype(jnp.int32)
        return GenerateOutput(final.tokens, final.num_tokens, final.steps, one_per_step,
                              jnp.zeros_like(final.tokens, bool))
    stats = (final.tokens.shape[0],) + spec.stat_shape
    return GenerateOutput(final.tokens, final.num_tokens, final.steps, final.accept_lengths, final.drafted,
                          final.node_tries.reshape(stats), final.node_hits.reshape(stats))


@HostChecked
@functools.partial(jax.jit, static_argnames=("spec", "cache_size"))
def decode(params: dict, draft_params: Any, prompt: jax.Array, prompt_lengths: jax.Array, rng: jax.Array, *,
           spec: DecodeSpec, cache_size: int) -> GenerateOutput:
    """The one decode entry: prefill (`init`), then `step` until every row of right-padded `prompt [B, T]` is
    done, for AR (`spec.drafter` None, `draft_params` None) and speculative decoding alike. Greedy speculative
    output equals AR's token for token. `cache_size` slots hold the prompt, the new tokens and a verify forward's
    scratch slots (checked at trace time)."""
    if spec.drafter is not None:
        draft_params = spec.drafter.decode_params(draft_params, Target(spec.config, params))
    state = init(params, draft_params, prompt, prompt_lengths, rng, cache_size, spec)
    final = jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: step(params, draft_params, s, spec), state)
    return output(final, spec)


def _advance(step: Callable[[Any], Any], state: Any, steps: int, until_done: jax.Array | None = None) -> Any:
    """At most `steps` iterations of `step` (a decode step on `ARState` or `SpecState`), fewer once every row is
    done, or once `until_done` rows are (in-flight batching: the caller then refills them): a chunk of a stream."""
    batch = state.done.shape[0]
    enough = batch if until_done is None else until_done

    def body(carry: tuple[jax.Array, Any]) -> tuple[jax.Array, Any]:
        return carry[0] + 1, step(carry[1])

    return jax.lax.while_loop(lambda c: (c[0] < steps) & (jnp.sum(c[1].done) < enough), body,
                              (jnp.zeros((), jnp.int32), state))[1]


@functools.partial(jax.jit, static_argnames=("spec", "cache_size"))
def start(params: dict, draft_params: Any, prompt: jax.Array, prompt_lengths: jax.Array, rng: jax.Array, *,
          spec: DecodeSpec, cache_size: int) -> ARState | SpecState:
    """`decode`'s state after the prefill (`init`, jitted); `advance` then runs its steps in chunks, with the same
    tokens as one whole `decode`. `draft_params` in the drafter's decode layout (`drafter.decode_params`, made once
    by the caller)."""
    return init(params, draft_params, prompt, prompt_lengths, rng, cache_size, spec)


def on_tree(state: SpecState, spec: DecodeSpec, prompt_length: int) -> SpecState:
    """A `start`ed speculative state (no step taken) as `start` makes it under `spec`'s tree: the state after the
    prefill is the tree's only through its per-node statistics (`node_tries`, `node_hits`, zero then), so another
    tree of the same drafter, prompts, cache size and new tokens starts from the same prefill, without compiling
    one of its own. Checked: no step taken, and the cache holds `spec`'s prompt, new tokens and scratch slots."""
    if int(state.steps) != 0 or state.tokens.shape[1] != spec.max_new_tokens:
        raise DecodeSpecError("state", f"{int(state.steps)} steps, {state.tokens.shape[1]} new tokens",
                              f"a state straight after its prefill, with {spec.max_new_tokens} new tokens")
    _check_static_fit(spec, prompt_length, state.cache.size)
    stats = _no_node_stats(state.done.shape[0], spec)
    return state.replace(node_tries=stats, node_hits=stats)


def _no_node_stats(batch: int, spec: DecodeSpec) -> jax.Array:
    """`[B, D * R]` zero per-node counts (`SpecState.node_tries` / `node_hits` before any step) for `spec`'s tree."""
    return jnp.zeros((batch, spec.stat_shape[0] * spec.stat_shape[1]), jnp.int32)


@functools.partial(jax.jit, static_argnames=("spec", "steps"), donate_argnames=("state",))
def advance(params: dict, draft_params: Any, state: ARState | SpecState, until_done: jax.Array | None = None, *,
            spec: DecodeSpec, steps: int) -> ARState | SpecState:
    """Up to `steps` more decode steps of a `start`ed generation, fewer once every row is done or, given
    `until_done` (a traced count: any value, one program), once that many rows are; `draft_params` as
    `start`'s. `state` is donated (the loop carries its cache in place): use the state returned."""
    return _advance(lambda s: step(params, draft_params, s, spec), state, steps, until_done)


def ar_idle(config: ModelConfig, batch: int, cache_size: int, max_new_tokens: int, rng: jax.Array,
            dtype: jnp.dtype = jnp.float32, pad_id: int = 0) -> ARState:
    """An autoregressive state whose `batch` rows are all done and empty: in-flight batching `refill`s its slots."""
    return ARState(cache=new_cache(config, batch, cache_size, dtype), last=jnp.full((batch,), pad_id, jnp.int32),
                   tokens=jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
                   num_tokens=jnp.zeros((batch,), jnp.int32), done=jnp.ones((batch,), bool),
                   steps=jnp.zeros((), jnp.int32), rng=rng)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def refill(params: dict, state: ARState, slots: jax.Array, prompt: jax.Array, prompt_lengths: jax.Array,
           rng: jax.Array, *, spec: DecodeSpec) -> ARState:
    """In-flight batching: start the right-padded prompts `[R, T]` in rows `slots [R]` of a running autoregressive
    state (rows that are done): their prefill (`ar_init` at the state's cache size), scattered over those rows'
    cache, tokens and flags; the other rows go on untouched. A slot `>= B` is dropped (padding up to a fixed R, so
    that a few refill sizes share programs). `state` is donated: its cache is updated in place."""
    if spec.speculative:
        raise DecodeSpecError("drafter", spec.drafter, "in-flight refill is autoregressive only: pass None")
    _check_static_fit(spec, prompt.shape[1], state.cache.size)
    new = ar_init(spec.model(params), params, prompt, prompt_lengths, rng, state.cache.size, spec.max_new_tokens,
                  spec.sampling, spec.eos_ids, spec.pad_id)

    def put(old: jax.Array, fresh: jax.Array, axis: int = 0) -> jax.Array:
        index = (slice(None),) * axis + (slots,)
        return old.at[index].set(fresh, mode="drop")

    cache = KVCache(put(state.cache.k, new.cache.k, 1), put(state.cache.v, new.cache.v, 1),
                    put(state.cache.lengths, new.cache.lengths))
    return state.replace(cache=cache, last=put(state.last, new.last), tokens=put(state.tokens, new.tokens),
                         num_tokens=put(state.num_tokens, new.num_tokens), done=put(state.done, new.done))
