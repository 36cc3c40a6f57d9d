"""Acceptance rules over a verified draft tree: greedy, typical acceptance, lossless tree rejection sampling.

Inputs are the tree's node tokens `[B, N]` (node 0 = the root, the token the target produced last step),
the target's fp32 logits at every node `[B, N, V]` (the distribution of the token *after* that node) and
the `TreeArrays`. Output: the accepted root-to-node path `accepted_nodes [B, D + 1]` (node ids, -1 past
`n_accepted`), `n_accepted [B]` (the root included, so >= 1), and the `bonus [B]` token drawn from the
target at the last accepted node.

* greedy: the longest path whose every token is the argmax of its parent's logits (first such path in
  path order on ties); bonus = argmax. Exactly the AR greedy output.
* typical (Medusa): a token is accepted when its target probability exceeds
  `min(posterior_threshold, posterior_alpha * exp(-entropy))`; longest path; bonus sampled from the target.
  Not distribution-preserving: a speed/quality trade-off, as in Medusa.
* rejection (lossless): walk down from the root; at each node try its children in rank order, accepting
  child token x with probability `min(1, p(x) / q(x))`; on rejection the target distribution becomes the
  residual `normalize(max(p - q, 0))`. When no child is accepted the bonus is drawn from the residual.
  `q` is the drafter's distribution for each node (`[B, N, V]`), or None for deterministic (top-k)
  proposals, where q is a point mass on the node's token: then a rejected token's probability is zeroed
  and the rest renormalised. Either way the committed tokens follow the target distribution exactly,
  under one contract for drafters that pass `q`: the siblings under a node must be drawn independently
  from that same `q` (SpecInfer's multi-step speculative sampling). Top-k or without-replacement
  candidates are deterministic given the context and must use `q = None` instead.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
from flax import struct

from amphista_jax.infra.errors import UsageError
from amphista_jax.trees.sampling import SamplingConfig, warp_logits
from amphista_jax.trees.tree import TreeArrays, children


class AcceptanceRule(enum.StrEnum):
    GREEDY = "greedy"
    TYPICAL = "typical"
    REJECTION = "rejection"


@dataclasses.dataclass(frozen=True)
class AcceptanceConfig:
    """How to accept draft tokens. `rule=None` picks greedy at temperature 0 and rejection otherwise; a
    rule's name is accepted in place of the enum."""

    rule: AcceptanceRule | None = None
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self) -> None:
        if self.rule is not None:
            try:
                object.__setattr__(self, "rule", AcceptanceRule(self.rule))
            except ValueError:
                raise UsageError(f"acceptance rule {self.rule!r} is not one of {', '.join(AcceptanceRule)}") from None

    def resolve(self, sampling: SamplingConfig) -> AcceptanceRule:
        if self.rule is None:
            return AcceptanceRule.GREEDY if sampling.greedy else AcceptanceRule.REJECTION
        if self.rule == AcceptanceRule.GREEDY and not sampling.greedy:
            raise UsageError("greedy acceptance needs temperature 0; use 'rejection' (lossless) or 'typical'")
        return self.rule


@struct.dataclass
class Verdict:
    accepted_nodes: jax.Array  # [B, D + 1] node ids on the accepted path, -1 past n_accepted
    n_accepted: jax.Array  # [B] accepted nodes, root included (>= 1)
    bonus: jax.Array  # [B] the target's token after the last accepted node


def _longest_path(node_ok: jax.Array, tree: TreeArrays) -> tuple[jax.Array, jax.Array]:
    """node_ok [B, N]: node's token accepted given its parent. Returns (accepted_nodes, n_accepted)."""
    paths = tree.paths  # [B, P, D+1]
    b, p, width = paths.shape
    along = jnp.take_along_axis(node_ok, jnp.maximum(paths[:, :, 1:], 0).reshape(b, -1), 1).reshape(b, p, -1)
    ok = (paths[:, :, 1:] >= 0) & along  # [B, P, D]
    run = jnp.cumprod(ok.astype(jnp.int32), axis=-1).sum(-1)  # [B, P] accepted drafts along each path
    best = jnp.argmax(run, axis=-1)  # [B] first longest
    n_accepted = jnp.take_along_axis(run, best[:, None], 1)[:, 0] + 1
    nodes = jnp.take_along_axis(paths, best[:, None, None], 1)[:, 0]  # [B, D+1]
    nodes = jnp.where(jnp.arange(width)[None] < n_accepted[:, None], nodes, -1)
    return nodes, n_accepted


def last_accepted_node(verdict: Verdict) -> jax.Array:
    """`[B]` the deepest accepted node (whose logits gave the bonus token)."""
    return jnp.take_along_axis(verdict.accepted_nodes, (verdict.n_accepted - 1)[:, None], 1)[:, 0]


def verify_greedy(tokens: jax.Array, logits: jax.Array, tree: TreeArrays) -> Verdict:
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, N] target's choice after each node
    node_ok = tree.valid & (tokens == jnp.take_along_axis(best, tree.parent, 1))
    nodes, n = _longest_path(node_ok, tree)
    last = last_accepted_node(Verdict(nodes, n, n))
    return Verdict(nodes, n, jnp.take_along_axis(best, last[:, None], 1)[:, 0])


def verify_typical(tokens: jax.Array, logits: jax.Array, tree: TreeArrays, sampling: SamplingConfig,
                   cfg: AcceptanceConfig, rng: jax.Array) -> Verdict:
    warped = warp_logits(logits, sampling)  # [B, N, V]
    logp = jax.nn.log_softmax(warped, axis=-1)
    entropy = -jnp.sum(jnp.where(jnp.isfinite(logp), jnp.exp(logp) * logp, 0.0), axis=-1)  # [B, N]
    parent_logp = jnp.take_along_axis(logp, tree.parent[:, :, None], 1)  # [B, N, V] the target after the parent
    token_p = jnp.exp(jnp.take_along_axis(parent_logp, tokens[:, :, None], -1)[..., 0])  # [B, N]
    limit = jnp.minimum(cfg.posterior_threshold,
                        cfg.posterior_alpha * jnp.exp(-jnp.take_along_axis(entropy, tree.parent, 1)))
    nodes, n = _longest_path(tree.valid & (token_p > limit), tree)
    last = last_accepted_node(Verdict(nodes, n, n))
    bonus_logits = jnp.take_along_axis(warped, last[:, None, None], 1)[:, 0]
    return Verdict(nodes, n, jax.random.categorical(rng, bonus_logits).astype(jnp.int32))


def verify_rejection(tokens: jax.Array, logits: jax.Array, tree: TreeArrays, sampling: SamplingConfig,
                     rng: jax.Array, q: jax.Array | None = None) -> Verdict:
    probs = jax.nn.softmax(warp_logits(logits, sampling), axis=-1)  # [B, N, V]
    depth, width = tree.max_depth, tree.max_children

    def one(tok: jax.Array, p_all: jax.Array, q_all: jax.Array | None, kids: jax.Array, key: jax.Array):
        # One try per loop turn: child `c` of `cur` at depth `d`. The walk stops at the first node none of whose
        # children is accepted (or at the depth budget), so a step costs the nodes actually tried, not N.
        def trying(s: tuple) -> jax.Array:
            d, c, cur, _, _ = s
            return (d < depth) & (c < width) & (kids[cur, jnp.minimum(c, width - 1)] >= 0)

        def try_child(s: tuple) -> tuple:
            d, c, cur, p, path = s
            child = kids[cur, c]
            x = tok[child]
            u = jax.random.uniform(jax.random.fold_in(key, d * width + c))
            if q_all is None:  # point mass on x: accept with p(x); residual = p without x
                accept = u < p[x]
                residual = p.at[x].set(0.0) / jnp.maximum(1.0 - p[x], 1e-20)
            else:
                qd = q_all[child]
                accept = u < p[x] / jnp.maximum(qd[x], 1e-20)
                residual = jnp.maximum(p - qd, 0.0)
                residual = residual / jnp.maximum(residual.sum(), 1e-20)
            p = jnp.where(accept, p_all[child], residual)
            path = jnp.where(accept, path.at[d + 1].set(child), path)
            return d + accept, jnp.where(accept, 0, c + 1), jnp.where(accept, child, cur), p, path

        path = jnp.full((depth + 1,), -1, jnp.int32).at[0].set(0)
        d, _, _, p, path = jax.lax.while_loop(trying, try_child, (jnp.int32(0), jnp.int32(0), jnp.int32(0),
                                                                  p_all[0], path))
        bonus = jax.random.categorical(jax.random.fold_in(key, 10_000), jnp.log(p))
        return path, d + 1, bonus.astype(jnp.int32)

    keys = jax.random.split(rng, tokens.shape[0])
    path, count, bonus = jax.vmap(one, in_axes=(0, 0, None if q is None else 0, 0, 0))(tokens, probs, q,
                                                                                   children(tree), keys)
    return Verdict(path, count, bonus)


def verify(tokens: jax.Array, logits: jax.Array, tree: TreeArrays, sampling: SamplingConfig,
           acceptance: AcceptanceConfig, rng: jax.Array, q: jax.Array | None = None) -> Verdict:
    """Apply the acceptance rule that `acceptance` resolves to for `sampling`."""
    rule = acceptance.resolve(sampling)
    if rule == AcceptanceRule.GREEDY:
        return verify_greedy(tokens, logits, tree)
    if rule == AcceptanceRule.TYPICAL:
        return verify_typical(tokens, logits, tree, sampling, acceptance, rng)
    return verify_rejection(tokens, logits, tree, sampling, rng, q)
