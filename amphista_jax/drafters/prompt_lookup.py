"""Prompt lookup (n-gram matching): a drafter with no model and no parameters, as vLLM, SGLang and Hugging Face
ship it. The tokens that followed the last `n` tokens' most recent earlier occurrence in the row's own text
(prompt and output) are proposed as a chain; editing, summarising or quoting text repeats it, so those drafts
are often right, and drafting costs a few comparisons over the row's history. On a tree, the root's children
rank distinct matches: child `r` starts the continuation of the `r`-th best match whose continuation starts with a
token no better match's does, and its chain of first children (`[r, 0, 0, ...]`) carries on that continuation.

State: each row's known text, `history [B, L]` (`L` = the cache size), and `length [B]`, how many of its tokens
are known: the committed ones and the root (the target's own next token, certain to be committed), so the root
sits at `length - 1`. `prefill` writes the prompt and the first token; `commit` appends the tokens that follow
each accepted node (`accepted_tokens`: the accepted drafts, then the bonus, the next root).

Matching (`lookup`), per row and on device: for `n` from `max_ngram` down to `min_ngram`, the last `n` known tokens
(ending with the root) are compared with every earlier window of `n` known tokens; the longest `n` with a match
wins, and among its matches the most recent (latest start). Its continuation (the tokens after the match) drafts
depth 1, 2, ... of the chain; it only reads known tokens, so a continuation that reaches the root drafts no further.
The next branch takes the best remaining match by the same order after dropping every match whose continuation
starts with a token an earlier branch drafts. Nodes without a draft (no match, past the known text, or a node below
depth 1 that is not a first child: a continuation has one next token) are proposed invalid (`TreeArrays.valid`
False, their token the root's as a placeholder): never attended to by a real node nor accepted, so such a step
commits the root's bonus token alone, as autoregressive decoding would. Drafts are deterministic (`q = None`):
lossless under greedy and rejection acceptance alike."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.drafters.base import DraftContext, Drafter, PrefillContext, Proposal, accepted_hidden, accepted_tokens
from amphista_jax.infra.errors import UserError
from amphista_jax.infra.ranges import setting
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output
from amphista_jax.models.target import Target
from amphista_jax.trees.tree import Tree, TreeArrays, batched, tree_arrays
from amphista_jax.trees.verify import Verdict


class NothingToTrainError(UserError, ValueError):
    """A method with no parameters asked to train."""


@Drafter.register
@dataclasses.dataclass(frozen=True)
class PromptLookup(Drafter):
    """Drafts the continuation of the longest, most recent earlier occurrence of the row's last n-gram.

    `max_ngram = 3` and `min_ngram = 1` (Hugging Face's `prompt_lookup` falls back to single tokens too): a
    longer n-gram predicts its continuation better, while a shorter one still finds something to draft, and a
    draft costs nothing here (the verify forward has the same fixed shape with or without it), so a weak guess is
    better than none. The paper tree is `chain-4`: a match drafts one continuation, a chain; four tokens keep the
    verify forward small on a CPU, where each extra node costs (the draft model's default too). `branches`: how
    many distinct matches a tree's root may rank (e.g. `fan-2x4`: the two best, four tokens each).
    """

    name = "prompt_lookup"
    trainable = False
    paper_tree = "chain-4"
    max_ngram: int = setting(3, ge=1)
    min_ngram: int = setting(1, ge=1)
    branches: int = setting(4, ge=1, why="1: chains only")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram={self.min_ngram} and max_ngram={self.max_ngram} must satisfy 1 <= min_ngram "
                             "<= max_ngram")

    def rankable(self, vocab_size: int) -> int:
        """The root's children rank up to `branches` distinct matches; below them a continuation has one next
        token (a tree's other children there draft nothing)."""
        return self.branches

    def init(self, rng: jax.Array, target: Target) -> dict:
        return {}

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> dict:
        return {"history": jnp.zeros((batch, cache_size), jnp.int32), "length": jnp.zeros((batch,), jnp.int32)}

    def prefill(self, params: dict, target: Target, prompt: PrefillContext, state: dict) -> dict:
        b, t = prompt.prompt.shape
        history = state["history"].at[:, :t].set(prompt.prompt.astype(jnp.int32))
        history = history.at[jnp.arange(b), prompt.lengths].set(prompt.root)  # the root after the prompt
        return {"history": history, "length": prompt.lengths + 1}

    def commit(self, params: dict, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: dict) -> tuple[dict, jax.Array]:
        new = accepted_tokens(proposal, verdict)  # [B, D + 1]: the accepted drafts, then the bonus
        return append(state, new, verdict.n_accepted), accepted_hidden(verdict, verify_out)

    def propose(self, params: dict, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        branch = np.array([0] + [path[0] for path in tree.choices])  # [N] the match each node continues
        first_children = np.array([True] + [not any(path[1:]) for path in tree.choices])  # [N]
        drafts, known = lookup(ctx.state["history"], ctx.state["length"], self.max_ngram, self.min_ngram,
                               tree.depth, int(branch.max()) + 1)  # [B, K, D] each
        layout = tree_arrays(tree)
        at = np.maximum(layout.depth - 1, 0)  # [N] each node's draft (node [r, 0, ...] at depth d: match r's d-th)
        valid = (layout.depth == 0) | (first_children & known[:, branch, at])  # [B, N] (no padding in the layout)
        tokens = jnp.where(valid, drafts[:, branch, at], ctx.root[:, None]).at[:, 0].set(ctx.root)  # [B, N]
        return Proposal(tokens, only_valid(batched(layout, ctx.root.shape[0]), valid))

    def loss(self, params: dict, target: Target, batch: dict, target_out: Output | None) -> tuple[jax.Array, dict]:
        raise NothingToTrainError(f"{self.name} has no parameters to train: use it directly (e.g. "
                                  f"`amphista-jax generate --draft {self.name}`)")


def lookup(history: jax.Array, length: jax.Array, max_ngram: int, min_ngram: int, depth: int,
           branches: int = 1) -> tuple[jax.Array, jax.Array]:
    """The continuations of each row's best earlier n-gram matches: `history [B, L]` of which the first `length
    [B]` tokens are known -> (`drafts [B, branches, depth]`, `known [B, branches, depth]` bool: a draft there).

    The n-gram is `history[length - n : length]`; a match starts at `i < length - n` (an earlier window, which
    may overlap the n-gram itself) and its continuation is `history[i + n :]`, cut at `length`. A continuation
    start `c` ranks by the longest n matching before it, then by recency (the latest `c`); branch 0 is the best,
    branch `k` the best whose first token `history[c]` no earlier branch's has. Branches without a match have no
    drafts (`known` all False; `drafts` there are arbitrary tokens)."""
    b, size = history.shape
    pos = jnp.arange(size)
    longest = jnp.zeros((b, size), jnp.int32)  # [B, L] the longest n matching before continuation start c (0: none)
    for n in range(min_ngram, max_ngram + 1):  # a longer n-gram's match overrides a shorter one's
        gram = jnp.take_along_axis(history, jnp.clip(length[:, None] - n + jnp.arange(n), 0, size - 1), 1)  # [B, n]
        match = pos[None] < (length - n)[:, None]  # [B, L] windows that start early enough
        for j in range(n):  # window i's j-th token is history[i + j]
            shifted = jnp.pad(history[:, j:], ((0, 0), (0, j)))  # [B, L]
            match = match & (shifted == gram[:, j:j + 1])
        at_start = jnp.pad(match[:, :size - n], ((0, 0), (n, 0)))  # [B, L] window i = c - n matched
        longest = jnp.where(at_start, n, longest)
    score = jnp.where(longest > 0, longest * size + pos[None], -1)  # [B, L] longest n first, then the latest
    starts = []
    for _ in range(branches):
        best = jnp.argmax(score, axis=1)  # [B]
        found = jnp.take_along_axis(score, best[:, None], 1)[:, 0] >= 0
        starts.append(jnp.where(found, best, -1))
        first = jnp.take_along_axis(history, best[:, None], 1)  # [B, 1] its continuation's first token
        score = jnp.where(found[:, None] & (history == first), -1, score)  # drop matches drafting the same token
    start = jnp.stack(starts, 1)  # [B, K] where each branch's continuation starts (-1: none)
    idx = start[:, :, None] + jnp.arange(depth)  # [B, K, depth]
    known = (start[:, :, None] >= 0) & (idx < length[:, None, None])
    return jnp.take_along_axis(history, jnp.clip(idx, 0, size - 1).reshape(b, -1), 1).reshape(idx.shape), known


def only_valid(tree: TreeArrays, valid: jax.Array) -> TreeArrays:
    """`tree [B, ...]` with only the nodes `valid [B, N]` real (a valid node's parent must be valid): the others
    become padding, which sees only itself, is seen by no real node and lies on no path."""
    n = valid.shape[1]
    both = valid[:, :, None] & valid[:, None, :]  # [B, N, N]
    on_path = jnp.take_along_axis(valid, jnp.maximum(tree.paths, 0).reshape(valid.shape[0], -1), 1)
    return tree.replace(valid=valid, mask=(tree.mask & both) | jnp.eye(n, dtype=bool),
                        paths=jnp.where(on_path.reshape(tree.paths.shape), tree.paths, -1))


def append(state: dict, tokens: jax.Array, count: jax.Array) -> dict:
    """`state` with the first `count [B]` of `tokens [B, T]` written after each row's known tokens."""
    history, length = state["history"], state["length"]
    idx = jnp.arange(tokens.shape[1])[None]
    dest = jnp.where(idx < count[:, None], length[:, None] + idx, history.shape[1])  # [B, T] out of range: dropped
    history = jax.vmap(lambda row, d, t: row.at[d].set(t, mode="drop"))(history, dest, tokens.astype(jnp.int32))
    return {"history": history, "length": length + count}
