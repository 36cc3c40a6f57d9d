"""The draft-head train step: frozen target forward (once per batch) + the drafter's loss, one `jax.jit`.

A drafter with `loss_runs_target = True` (BiTA) runs the target inside its own loss (`target_out` is None):
gradients then flow through the target's activations into the draft params. Either way only the draft params
are differentiated and updated; the target's params stay frozen.

With a mesh, the target's params are sharded by their logical axes, so are the draft params and, like them,
their optimizer state (`sharding.train_state_shardings`; replicated when none are given), and the batch is split
over `data` x `fsdp`; without one the same function runs on the default device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from amphista_jax.drafters.base import Drafter
from amphista_jax.drafters.draft_vocab import DraftVocab, project_columns, restrict
from amphista_jax.engine.sharding import BATCH_AXES, LOGICAL_RULES, local_batch_shards
from amphista_jax.models.llama import Output, Transformer
from amphista_jax.models.param_layout import output_projection
from amphista_jax.models.target import Target
from amphista_jax.train.config import LossConfig


def target_forward(model: Transformer, target_params: dict, batch: dict[str, jax.Array],
                   captures: tuple[int, ...] = (), columns: DraftVocab = ()) -> Output:
    """The frozen target's last-layer hidden states and fp32 logits over `batch["tokens"] [B, T]` (and the
    inputs of layers `captures`, `Output.captured`). `columns`: the logits' vocabulary columns (a draft
    vocabulary: `[B, T, V_d]`); () = all `V`.

    When the batch carries precomputed `hidden [B, T, D]` (and `captured [B, T, C * D]`) only the output
    projection runs, on `columns` alone.
    """
    if "hidden" in batch:
        hidden = batch["hidden"].astype(jnp.float32)
        logits = hidden @ project_columns(output_projection(target_params), columns).astype(jnp.float32)
        captured = batch["captured"].astype(jnp.float32) if captures else None
        return jax.lax.stop_gradient(Output(hidden, logits, None, captured))
    tokens = batch["tokens"]
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = model.apply({"params": target_params}, tokens, positions, captures=captures)
    captured = None if out.captured is None else out.captured.astype(jnp.float32)
    return jax.lax.stop_gradient(out.replace(hidden=out.hidden.astype(jnp.float32), captured=captured,
                                             logits=restrict(out.logits, columns)))


def with_target_labels(batch: dict, target_out: Output | None, loss: LossConfig) -> dict:
    """`batch` with the labels `loss` asks for, read by the drafters' losses (`drafters.losses.batch_labels`,
    `target_kl`, `head_losses`' `agree`). `greedy [B, T]`: the target's own greedy token for each position (its
    argmax one position before; the first position keeps the data's token, which no head learns), from the
    label store's top-1 (`label_ids`) or the target's logits, whenever either is there: what every head's
    agreement with the target is measured on. `labels: target` makes it the hard label (`labels`); with `kind:
    kl` the store's top-k stays in the batch, or the logits go in as `label_logits`. Otherwise the store's top-k
    is dropped."""
    if "label_ids" in batch:
        best = batch["label_ids"][..., 0]
    elif target_out is not None:
        best = jnp.argmax(target_out.logits, axis=-1).astype(batch["tokens"].dtype)
    elif loss.labels == "target":
        raise ValueError("loss.labels target needs the target's logits or a label store")
    else:
        return batch
    tokens = batch["tokens"]
    greedy = jnp.concatenate([tokens[:, :1], best[:, :-1].astype(tokens.dtype)], axis=1)
    out = {k: v for k, v in batch.items() if k not in ("label_ids", "label_logp")} | {"greedy": greedy}
    if loss.labels == "target":
        out["labels"] = greedy
        if loss.kind == "kl":
            out |= ({k: batch[k] for k in ("label_ids", "label_logp")} if "label_logp" in batch
                    else {"label_logits": target_out.logits})
    return out


def over_microbatches(fn: Callable[[dict, jax.Array], Any], batch: dict, rng: jax.Array, microbatches: int) -> Any:
    """`fn(batch, rng)` (a pytree of masked means: losses, metrics, their gradients) computed over `microbatches`
    slices one after another (`lax.scan`), so that only one slice's activations are live: gradient accumulation.

    Slice j holds rows j, j + k, j + 2k, ... (k = `microbatches`), so every device keeps its own rows; its key is
    `fold_in(rng, j)`. The slices' results are averaged weighted by their loss tokens (`loss_mask`), so a slice
    with few (or none) counts as little: this equals the whole batch's mean exactly when every term's mask is the
    row's `loss_mask` or a fixed shift of it on whole rows (rows trained or not), and closely otherwise (a head's
    shifted mask loses up to its depth in tokens per row)."""
    if microbatches == 1:
        return fn(batch, rng)
    k = microbatches

    def rows(x: jax.Array) -> jax.Array:  # [B, ...] -> [k, B / k, ...]
        return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)

    def body(total: tuple[Any, jax.Array], j_slice: tuple[jax.Array, dict]) -> tuple[tuple[Any, jax.Array], None]:
        j, part = j_slice
        with nn.logical_axis_rules(LOGICAL_RULES):
            part = jax.tree.map(lambda x: nn.with_logical_constraint(x, ("batch",) + (None,) * (x.ndim - 1)), part)
        weight = part["loss_mask"].sum().astype(jnp.float32)
        out = fn(part, jax.random.fold_in(rng, j))
        return (jax.tree.map(lambda t, x: t + weight * x, total[0], out), total[1] + weight), None

    slices = (jnp.arange(k), jax.tree.map(rows, batch))
    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(fn, jax.tree.map(lambda x: x[0], slices[1]), rng))
    (total, weight), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), slices)
    return jax.tree.map(lambda t: t / jnp.maximum(weight, 1.0), total)


def make_steps(model: Transformer, drafter: Drafter, optimizer: optax.GradientTransformation,
               mesh: Mesh | None = None, target_shardings: Any = None, state_shardings: dict | None = None,
               microbatches: int = 1, loss: LossConfig | None = None):
    """(train_step(state, target_params, batch) -> (state, metrics), eval_step(params, target_params, batch)
    -> metrics), jitted; sharded over `mesh` when given (`state_shardings`: the train state's, by default
    replicated). Both run the batch as `microbatches` sequential slices (`over_microbatches`): the update is the
    one of the slices' loss-token weighted mean loss, with 1/`microbatches` of the activation memory. `loss`
    chooses the labels (`with_target_labels`)."""

    runs_target = drafter.loss_runs_target
    loss = loss or LossConfig()

    def loss_fn(params, target_params, batch):
        target = Target(model.config, target_params)
        with nn.logical_axis_rules(LOGICAL_RULES):
            if runs_target:  # the drafter runs the frozen target in its loss: gradients reach its params through it
                return drafter.loss(params, target, with_target_labels(batch, None, loss), None)
            # With the label store's greedy labels, the loss reads the target's logits only on the draft vocabulary
            # (`restrict`): on stored states the other columns are not computed (EAGLE-3's 4096 of 49152 columns: a
            # quarter of its step's FLOPs on SmolLM2); a whole forward computes them and `restrict` cuts them.
            columns = drafter.draft_vocab if "label_ids" in batch else ()
            target_out = target_forward(model, target_params, batch, drafter.captured_layers(model.config), columns)
            # Pinned here, so that the drafter's shardings do not propagate back into the target's forward.
            target_out = target_out.replace(
                hidden=nn.with_logical_constraint(target_out.hidden, ("batch", "length", "embed")),
                logits=nn.with_logical_constraint(target_out.logits, ("batch", "length", "vocab")))
        return drafter.loss(params, target, with_target_labels(batch, target_out, loss), target_out)

    def train_step(state, target_params, batch):
        # Training-time randomness for the losses that use it (Hydra's embedding noise); eval gets none.
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, metrics), grads = over_microbatches(
            lambda part, rng: grad_fn(state["params"], target_params, part | {"rng": rng}), batch,
            jax.random.fold_in(jax.random.key(0), state["step"]), microbatches)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = metrics | {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def eval_step(params, target_params, batch):
        loss, metrics = over_microbatches(lambda part, _: loss_fn(params, target_params, part), batch,
                                          jax.random.key(0), microbatches)
        return metrics | {"loss": loss}

    # keep_unused: a target weight the loss never reads (Medusa's lm_head) is resident all the same, and so is
    # counted in the compiled step's arguments (what a memory plan reads).
    if mesh is None:
        return (Step(jax.jit(train_step, donate_argnums=0, keep_unused=True)),
                Step(jax.jit(eval_step, keep_unused=True)))
    replicated = NamedSharding(mesh, PartitionSpec())
    state = state_shardings or replicated
    params = replicated if state_shardings is None else state_shardings["params"]
    batch_spec = Step.batch_spec(mesh)
    train = jax.jit(train_step, in_shardings=(state, target_shardings, batch_spec),
                    out_shardings=(state, replicated), donate_argnums=0, keep_unused=True)
    evaluate = jax.jit(eval_step, in_shardings=(params, target_shardings, batch_spec), out_shardings=replicated,
                       keep_unused=True)
    return Step(train, mesh), Step(evaluate, mesh)


@dataclasses.dataclass(frozen=True)
class Step:
    """A jitted step `(state or draft params, target params, batch)`. With a mesh it runs inside it, and each
    process passes the rows of the global batch its devices hold (`sharding.process_batch_rows`)."""

    jitted: Any  # the `jax.jit` function
    mesh: Mesh | None = None

    @staticmethod
    def batch_spec(mesh: Mesh) -> NamedSharding:
        return NamedSharding(mesh, PartitionSpec(BATCH_AXES))

    @functools.cached_property
    def _shard_ratio(self) -> tuple[int, int]:
        """(the mesh's batch shards, this process's): a local batch's rows x this ratio = the global batch's (processes
        sharing a shard hold the same rows). Found once, not per step."""
        mine, ways = local_batch_shards(self.mesh)
        return ways, len(mine)

    def __call__(self, state_or_params: Any, target_params: dict, local_batch: dict) -> Any:
        if self.mesh is None:
            return self.jitted(state_or_params, target_params, local_batch)
        spec, (ways, mine) = self.batch_spec(self.mesh), self._shard_ratio

        def global_array(x: np.ndarray) -> jax.Array:
            shape = (x.shape[0] * ways // mine, *x.shape[1:])
            return jax.make_array_from_process_local_data(spec, np.asarray(x), shape)

        batch = jax.tree.map(global_array, local_batch)
        with jax.set_mesh(self.mesh):
            return self.jitted(state_or_params, target_params, batch)

    def compile(self, state_or_params: Any, target_params: dict, batch: dict) -> jax.stages.Compiled:
        """Compiled ahead of time for global arguments (arrays or `jax.ShapeDtypeStruct`s): what a memory plan
        reads."""
        with jax.set_mesh(self.mesh) if self.mesh else contextlib.nullcontext():
            return self.jitted.lower(state_or_params, target_params, batch).compile()
