"""The draft-method contract (`docs/architecture.md`, section 2): `Drafter`, a base class whose defaults are the
documentation, and what drafters share at decode time (their shared losses: `losses.py`). The engine
(`engine/decode.py`) and the trainer call a drafter's members and never probe for them, nor branch on a method's
name.

A drafter is a frozen (hashable) dataclass of its static settings subclassing `Drafter`; `target` is the frozen
model, `target.Target(config, params)` (its config is static under `jax.jit`). Required: `init` (or, through
`LogicalInit`, `init_boxed`), `propose`, `loss`. Defaulted: `init_state` / `prefill` / `commit` (no state of
its own), `num_extras` (0) and `prefill_extras` (none), `decode_params` (identity), `loss_runs_target` (False),
`lm_setting` (none) and `reads_labels` (the loss has an LM term), `check_batches` (any batch), `trainable` (True),
`paper_tree`, `max_depth` (any depth), `tree_kinds` (static trees), `rankable` (the target's vocabulary) and
`sampling_at` (itself).
`check_tree` reads `tree_kinds`, `max_depth` and `rankable` to refuse a tree before anything compiles.
"""

from __future__ import annotations

import abc
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Self, TypeVar

import flax.linen as nn
import jax
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec

from amphista_jax.drafters.draft_vocab import (
    DraftVocab,
    project_columns,
    to_target,
    to_vocab,
)
from amphista_jax.infra.ranges import check_ranges
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.llama import Output
from amphista_jax.models.target import Extras, Target
from amphista_jax.trees.names import PAPER_TREE
from amphista_jax.trees.tree import (
    Tree,
    TreeArrays,
    TreeBudget,
    TreeError,
    TreeSpec,
    batched,
    fill_tree_from_topk,
    tree_arrays,
    tree_levels,
)
from amphista_jax.trees.verify import Verdict, last_accepted_node


@struct.dataclass
class DraftContext:
    hidden: jax.Array  # [B, D] target's last-layer hidden state at the node that produced `root`
    root: jax.Array  # [B] the target's own next token (tree node 0)
    lengths: jax.Array  # [B] committed tokens; the root sits at position `lengths`
    state: Any  # the method's own state


@struct.dataclass
class PrefillContext:
    out: Output  # the target over the padded prompt slots [B, T, D], then the prefill extras' [B, E, D] if any
    prompt: jax.Array  # [B, T] right-padded prompt tokens
    lengths: jax.Array  # [B] prompt lengths
    root: jax.Array  # [B] the target's first generated token (at position `lengths`)

    def next_tokens(self) -> jax.Array:
        """`[B, T]` the token after each prompt slot: the prompt's next one, the root after the last (slots past
        a row's length hold garbage)."""
        nxt = jax.numpy.roll(self.prompt, -1, axis=1)
        return nxt.at[jax.numpy.arange(nxt.shape[0]), self.lengths - 1].set(self.root)


@struct.dataclass
class Proposal:
    tokens: jax.Array  # [B, N] node tokens; node 0 is the root
    tree: TreeArrays  # [B, ...] per row: what the verify forward, acceptance and compaction read
    # [B, N, V] the distribution each node's token was drawn from; siblings must be i.i.d. draws from their
    # shared q. None = deterministic (top-k) drafts (see verify.py).
    q: jax.Array | None = None
    extras: Extras | None = None  # extra queries for the verify forward (seen by no tree node, never committed)


def logical(value: jax.Array, *names: str | None) -> nn.Partitioned:
    """`value` boxed with the logical axis names of its dimensions (`sharding.LOGICAL_RULES` maps them)."""
    return nn.Partitioned(value, names)


def head_projections(target: Target, num_heads: int, draft_vocab: DraftVocab = ()) -> nn.Partitioned:
    """`[K, D, V_d]` one vocabulary projection per head, each initialised from the target's `lm_head` (its
    `draft_vocab` columns; all `V` without one)."""
    lm_head = project_columns(target.lm_head(), draft_vocab)
    return logical(jax.numpy.broadcast_to(lm_head, (num_heads,) + lm_head.shape).copy(), None, "embed", "vocab")


def _fits(value: Any, hint: Any) -> bool:
    """Whether a setting read from JSON/YAML `value` is of a drafter field's type `hint` (ints are floats too; a
    list stands for a tuple; bool is not an int)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        return not isinstance(value, bool) and isinstance(value, int | float if hint is float else int)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        if not isinstance(value, tuple | list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args, strict=True))
    return True  # a kind of field this check does not know: its drafter checks it


def _type_name(hint: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"a list of {_type_name(typing.get_args(hint)[0]).removeprefix('an ').removeprefix('a ')}s"
    return names.get(hint, str(hint))


D = TypeVar("D", bound=type)
_REGISTERED: dict[str, type[Drafter]] = {}  # `Drafter.register`'s, by name


class Drafter(abc.ABC):
    """A draft method: a frozen dataclass of its static settings (hashable: static under `jax.jit`).

    Class attributes: `name`, the registry key (`drafters.DRAFTERS`, `draft.json`'s `method`); `loss_runs_target`,
    True when the loss runs the frozen target itself (BiTA's masks ride in its forward), so the train step passes
    no target output and lets gradients flow through the target's activations into the draft params;
    `tree_kinds`, the kinds of tree `propose` drafts: `TreeSpec` (a static tree it fills) and/or `TreeBudget`
    (the budget of a tree it grows on device every step); `trainable`, False for a method with nothing to learn
    (prompt lookup): its `init` is its whole drafter, front-ends use it by name without heads (and say nothing of
    untrained heads), and `amphista-jax train` refuses it.

    `draft_vocab` (`drafters.draft_vocab`): the sorted target ids a drafter's heads score (EAGLE-3's `d2t`), `()`
    for the whole vocabulary. A drafter that drafts over one declares it as a dataclass field (normalised in its
    `__post_init__` by `draft_vocab.normalise_field`); here it is the default of every other drafter.

    Each setting declares its range beside it (`num_heads: int = setting(4, ge=1)`, `infra.ranges`), checked by
    `Drafter.__post_init__`; a drafter's own `__post_init__` calls `super().__post_init__()`, then checks what
    relates settings to each other. `@Drafter.register` makes a drafter one that `drafters.DRAFTERS` names and a
    config builds from `drafter: {type: <name>, <settings>}` (`config_types`, read by `infra.config_io`).
    """

    name: ClassVar[str]
    loss_runs_target: ClassVar[bool] = False
    lm_setting: ClassVar[str | None] = None  # the setting that weighs the loss's LM term, where one does
    trainable: ClassVar[bool] = True
    tree_kinds: ClassVar[tuple[type, ...]] = (TreeSpec,)
    draft_vocab: DraftVocab = ()

    @classmethod
    def register(cls, drafter: D) -> D:
        """Class decorator: `drafter` under its `name`, in `config_types` (and so in `drafters.DRAFTERS`)."""
        if _REGISTERED.get(drafter.name, drafter) is not drafter:
            raise ValueError(f"two drafters named {drafter.name!r}: {_REGISTERED[drafter.name]} and {drafter}")
        _REGISTERED[drafter.name] = drafter
        return drafter

    @classmethod
    def config_types(cls) -> Mapping[str, type[Drafter]]:
        """The registered drafters by name (sorted): what a config's `drafter: {type: <name>, ...}` builds."""
        return types.MappingProxyType(dict(sorted(_REGISTERED.items())))

    def __post_init__(self) -> None:
        """The ranges the settings declare (`infra.ranges.check_ranges`): one `ValueError` line for the first
        setting outside its range."""
        check_ranges(self)

    @property
    def reads_labels(self) -> bool:
        """Whether the loss has an LM term on the labels `loss.labels` / `loss.kind` choose (`batch_labels`,
        `target_kl`): by default, yes unless its `lm_setting` weighs it 0. A loss without one learns the target's
        distribution through its teacher term alone (EAGLE's, EAGLE-3's and Hydra++'s by default): `labels:
        target, kind: kl` describes that term; `kind: ce` would ask for what it cannot learn (refused)."""
        return getattr(self, self.lm_setting) > 0 if self.lm_setting else True

    def check_batches(self, length_grouped: bool) -> None:
        """Raise ValueError where these settings cannot train on `length_grouped` batches (each cut at its longest
        row, `data.length_groups`): by default they all can."""
        del length_grouped

    @property
    def paper_tree(self) -> str:
        """The name of the tree the method's paper drafts (`trees.names.get_tree`): used where no tree is named and
        no acceptance statistics let `--tree auto` choose (and `amphista-jax plan`); always one of `auto`'s
        candidates."""
        return PAPER_TREE

    @property
    def max_depth(self) -> int | None:
        """The deepest draft token below the root this drafter can propose (heads: one depth each), or None
        when it drafts autoregressively to any depth."""
        return None

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Self:
        """`cls(**settings)` from settings read from a file (draft.json, a config, an eval spec): each is first
        checked to be one of the method's fields and of its type (a `ValueError` naming the setting, the value and
        the type it needs), so a string or a float where a count belongs stops here in one line, not inside a
        trace; the method's `__post_init__` then checks the values."""
        hints = typing.get_type_hints(cls)
        fields = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(settings) - fields):
            raise ValueError(f"{unknown} are not {cls.name} settings; known: {', '.join(sorted(fields))}")
        for key, value in settings.items():
            if not _fits(value, hints[key]):
                raise ValueError(f"{cls.name} setting {key}={value!r} must be {_type_name(hints[key])}")
        return cls(**settings)

    def rankable(self, vocab_size: int) -> int:
        """How many candidates a node's children can rank among: the target's vocabulary by default (a draft
        vocabulary where a drafter drafts over one)."""
        return len(self.draft_vocab) or vocab_size

    def check_tree(self, tree: Tree, vocab_size: int | None = None) -> None:
        """Raise `TreeError` (one line naming the fix) unless this drafter can draft `tree` for a target of
        `vocab_size` tokens: its kind, depth against `max_depth`, sibling ranks against `rankable`. Called before
        anything compiles: by `DecodeSpec` (once per spec), and by the facade as it chooses a tree."""
        kinds = " or ".join("a static tree" if k is TreeSpec else "a dynamic budget" for k in self.tree_kinds)
        if not isinstance(tree, self.tree_kinds):
            example = "--tree dynamic" if TreeBudget in self.tree_kinds else "--tree mc_sim_7b_63 or chain-4"
            raise TreeError(f"{self.name} drafts {kinds} (e.g. {example}), not {tree}")
        if self.max_depth is not None and tree.depth > self.max_depth:
            raise TreeError(f"tree depth {tree.depth} needs {tree.depth} heads but these {self.name} heads draft "
                            f"{self.max_depth} tokens deep: "
                            f"pick a tree of depth <= {self.max_depth} (e.g. --tree chain-{self.max_depth}) or "
                            "train more heads")
        if vocab_size is not None and tree.num_ranks > self.rankable(vocab_size):
            raise TreeError(f"the tree ranks {tree.num_ranks} siblings but {self.name} drafts from "
                            f"{self.rankable(vocab_size)} tokens: pick a tree with fewer children per node")

    def captured_layers(self, config: ModelConfig) -> tuple[int, ...]:
        """The target layers whose inputs (the residual stream before each) the drafter reads besides the last
        hidden state: every target forward of decoding and training then keeps them (`Output.captured`, `[B, T,
        C * D]`, in this order). None by default (EAGLE-3: low, middle and high)."""
        return ()

    def sampling_at(self, temperature: float, tree: Tree) -> Drafter:
        """The drafter for decoding at `temperature` on `tree` (a draft model samples its drafts at the target's
        temperature on a static tree); itself by default."""
        return self

    @abc.abstractmethod
    def init(self, rng: jax.Array, target: Target) -> Any:
        """Fresh draft params for `target` (untrained heads start here)."""

    def param_trees(self, target: Target) -> tuple[Any, ...]:
        """The abstract param trees (`jax.ShapeDtypeStruct` leaves) this drafter decodes with on `target` (whose
        params may be abstract too): `init`'s by default; the host checks given params against them. `()`: none
        to check against (an oracle whose params are given token rows)."""
        return (jax.eval_shape(lambda t: self.init(jax.random.key(0), t), target),)

    def init_state(self, target_config: ModelConfig, batch: int, cache_size: int) -> Any:
        """The method's own decoding state (zeroed caches) for `batch` rows of `cache_size` slots; none by default."""
        return ()

    def num_extras(self, tree: Tree) -> int:
        """How many extra queries (`Proposal.extras`) every proposal on `tree` adds to the verify forward; callers
        size the cache with it (`DecodeSpec.scratch`)."""
        return 0

    def prefill_extras(self, params: Any, target: Target, prompt: jax.Array, lengths: jax.Array) -> Extras | None:
        """Extra queries riding along the target's prefill forward over `prompt [B, T]` (BiTA's first masks)."""
        return None

    def prefill(self, params: Any, target: Target, prompt: PrefillContext, state: Any) -> Any:
        """Run the method's own layers over the prompt (fill its caches); returns the state."""
        return state

    def kept_params(self, params: Any) -> Any:
        """Params in `init`'s layout as a decoder keeps them between generations: as they are by default; a draft
        model's directory read with int8 `weights` is kept with int8 projections, made once at load
        (`drafter_source.load_draft_params`)."""
        return params

    def decode_params(self, params: Any, target: Target) -> Any:
        """The layout `propose` and `commit` read, made once per generation before the decode loop (from the
        drafter's params and, where it reads the target's, `target`'s)."""
        return params

    @abc.abstractmethod
    def propose(self, params: Any, target: Target, ctx: DraftContext, tree: Tree, rng: jax.Array) -> Proposal:
        """The tree's `N` node tokens (node 0 = `ctx.root`) and the tree as per-row device data, inside the
        static `tree` (a `TreeSpec` to fill or a `TreeBudget` to grow within), one `check_tree` has accepted."""

    def commit(self, params: Any, target: Target, proposal: Proposal, verdict: Verdict, verify_out: Output,
               state: Any) -> tuple[Any, jax.Array]:
        """Catch the method's state up with the accepted path (`verdict.accepted_nodes` of `proposal.tokens`, then
        `verdict.bonus`; `verify_out.hidden [B, N + E, D]`: the tree's nodes, then the extras') and choose the
        hidden state `[B, D]` the next proposal starts from: by default the target's at the last accepted node."""
        return state, accepted_hidden(verdict, verify_out)

    @abc.abstractmethod
    def loss(self, params: Any, target: Target, batch: dict, target_out: Output | None) -> tuple[jax.Array, dict]:
        """The paper's training objective. `batch` holds `tokens [B, T]` and `loss_mask [B, T]` (and in a train
        step `rng`); `target_out` is the frozen target's stop-gradient output, None when `loss_runs_target`."""


class LogicalInit(Drafter):
    """A drafter that defines `init_boxed(rng, target)`: its params with each leaf an `nn.Partitioned` naming its
    logical axes (flax nets through `nn.with_logical_partitioning`, the drafter's own arrays through `logical`);
    a leaf left plain is replicated. `init` is that tree unboxed. Every built-in drafter is one."""

    @abc.abstractmethod
    def init_boxed(self, rng: jax.Array, target: Target) -> Any:
        """`init`'s params, each leaf boxed with its logical axes."""

    def init(self, rng: jax.Array, target: Target) -> Any:
        return nn.unbox(self.init_boxed(rng, target))


def draft_param_shapes(drafter: Drafter, target: Target) -> tuple[Any, Any]:
    """(`jax.ShapeDtypeStruct` tree, logical-axis `PartitionSpec` tree) of `drafter.init`'s params, without
    allocating (like `llama.param_shapes`). A drafter that is not a `LogicalInit` has every parameter replicated."""
    key = jax.random.key(0)
    if not isinstance(drafter, LogicalInit):
        shapes = jax.eval_shape(drafter.init, key, target)
        return shapes, jax.tree.map(lambda _: PartitionSpec(), shapes)
    boxed = jax.eval_shape(drafter.init_boxed, key, target)
    return nn.unbox(boxed), nn.get_partition_spec(boxed)


def accepted_hidden(verdict: Verdict, verify_out: Output) -> jax.Array:
    """`[B, D]` the target's hidden state at the deepest accepted node (the one that produced the bonus)."""
    return jax.numpy.take_along_axis(verify_out.hidden, last_accepted_node(verdict)[:, None, None], axis=1)[:, 0]


def accepted_tokens(proposal: Proposal, verdict: Verdict) -> jax.Array:
    """`[B, D + 1]` the tokens that follow each accepted node: the next accepted node's token, and the bonus
    after the last one (entries past `n_accepted` are the bonus too; callers mask them)."""
    path = jax.numpy.take_along_axis(proposal.tokens, jax.numpy.maximum(verdict.accepted_nodes, 0), 1)  # [B, D+1]
    idx = jax.numpy.arange(path.shape[1])[None]
    return jax.numpy.where(idx < verdict.n_accepted[:, None] - 1, jax.numpy.roll(path, -1, axis=1),
                           verdict.bonus[:, None])


def split_heads(params: dict, names: Sequence[str] = ("lm_head",)) -> dict:
    """The decode-time layout of stacked per-head weights: each `params[name] [K, ...]` as a tuple of K arrays.

    Called once before the decode loop. A head's slice of a stacked weight is a copy under XLA:CPU, made on
    every step inside the loop; separate arrays are read in place (`evals/benchmarks/draft_overhead.py` times a
    drafter's part of a step)."""
    return params | {n: tuple(params[n][i] for i in range(params[n].shape[0])) for n in names
                     if n in params and not isinstance(params[n], tuple)}


Projection = jax.Array | Sequence[jax.Array]  # per-head `[K, D, F]` or K arrays `[D, F]`; or one shared `[D, F]`


def project_heads(x: jax.Array, weights: Projection, heads: int) -> jax.Array:
    """Projections of the first `heads` heads: `x [..., >= heads, D]` and `weights` `[K, D, F]` (stacked) or K
    arrays `[D, F]` (`split_heads`), one per head, or one `[D, F]` that every head shares -> `[..., heads, F]`.
    One matrix product per head: XLA:CPU runs a batched product over heads several times slower than separate
    ones once a head has more than one row; shared weights are one product over all heads' rows."""
    if not isinstance(weights, Sequence) and weights.ndim == 2:
        return x[..., :heads, :] @ weights
    return jax.numpy.stack([x[..., i, :] @ weights[i] for i in range(heads)], axis=-2)


def draft_by_levels(root: jax.Array, tree: TreeSpec, state: Any, logits: Callable[[int, Any], jax.Array],
                    extend: Callable[[int, Any, jax.Array], Any], draft_vocab: DraftVocab = ()) -> Proposal:
    """Deterministic top-k drafts (`q = None`) of a static tree, depth by depth, each node's children from its own
    path (Hydra, the semi-autoregressive drafter). `state` describes the nodes that have children at the current
    depth (leaves `[B, M, ...]`; at depth 0 the root alone), `logits(depth, state) -> [B, M, V_d]` drafts their
    children (over `draft_vocab`, ids mapped back), and `extend(depth, parents' state, tokens [B, E])` gives the
    state of the children that have children in turn."""
    b = root.shape[0]
    tokens = jax.numpy.zeros((b, tree.num_nodes), jax.numpy.int32).at[:, 0].set(root)
    for depth, level in enumerate(tree_levels(tree)):
        top = jax.lax.top_k(logits(depth, state), int(level.rank.max()) + 1)[1].astype(jax.numpy.int32)  # [B, M, k]
        top = to_target(top, draft_vocab)
        children = top[:, level.parent_slot, level.rank]  # [B, C]
        tokens = tokens.at[:, level.nodes].set(children)
        if len(level.expand):
            slots = level.parent_slot[level.expand]
            state = extend(depth, jax.tree.map(lambda x, slots=slots: x[:, slots], state), children[:, level.expand])
    return Proposal(tokens, batched(tree_arrays(tree), b))


def topk_proposal(logits: jax.Array, root: jax.Array, tree: TreeSpec, draft_vocab: DraftVocab = ()) -> Proposal:
    """Deterministic top-k drafts (`q = None`) of a static tree from per-head logits `[B, K, V_d]` over
    `draft_vocab` (ids mapped back to the target's)."""
    topk = to_target(jax.lax.top_k(logits, tree.num_ranks)[1].astype(jax.numpy.int32), draft_vocab)  # [B, K, R]
    return Proposal(fill_tree_from_topk(root, topk, tree), batched(tree_arrays(tree), root.shape[0]))


def sampled_proposal(logits: jax.Array, root: jax.Array, tree: TreeSpec, rng: jax.Array, temperature: float,
                     vocab_size: int, draft_vocab: DraftVocab = ()) -> Proposal:
    """Drafts of a static tree sampled from one draft distribution per depth, whatever the parent (`logits [B, K,
    V_d]` over `draft_vocab`, depth k + 1's at k; DFlash's block): every node at depth d is an independent draw
    from depth d's distribution at `temperature`, which the proposal passes on as the node's `q` (siblings are
    i.i.d. draws from one `q`: lossless under rejection sampling; siblings may repeat)."""
    arrays = tree_arrays(tree)
    dist = jax.nn.log_softmax(logits / temperature, axis=-1)[:, np.maximum(arrays.depth - 1, 0)]  # [B, N, V_d]
    draws = to_target(jax.random.categorical(rng, dist).astype(jax.numpy.int32), draft_vocab)  # [B, N]
    q = to_vocab(jax.numpy.exp(dist), draft_vocab, vocab_size)  # [B, N, V]
    return Proposal(draws.at[:, 0].set(root), batched(arrays, root.shape[0]), q)
