"""The draft-head train step: frozen target forward (once per batch) + the drafter's loss, one `jax.jit`.

With a mesh, the target's params are sharded by their logical axes, so are the draft params and, like them,
their optimizer state (`sharding.train_state_shardings`; replicated when none are given), and the batch is split
over `data` x `fsdp`; without one the same function runs on the default device.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from amphista_jax.drafters.base import Target
from amphista_jax.models.llama import Output, Transformer
from amphista_jax.sharding import BATCH_AXES, LOGICAL_RULES


def target_forward(model: Transformer, target_params: dict, batch: dict[str, jax.Array]) -> Output:
    """The frozen target's last-layer hidden states and fp32 logits over `batch["tokens"] [B, T]`.

    When the batch carries precomputed `hidden [B, T, D]` only the output projection runs.
    """
    if "hidden" in batch:
        hidden = batch["hidden"].astype(jnp.float32)
        logits = model.apply({"params": target_params}, hidden, method=Transformer.logits)
        return jax.lax.stop_gradient(Output(hidden, logits, None))
    tokens = batch["tokens"]
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = model.apply({"params": target_params}, tokens, positions)
    return jax.lax.stop_gradient(out.replace(hidden=out.hidden.astype(jnp.float32)))


def make_steps(model: Transformer, drafter: Any, optimizer: optax.GradientTransformation,
               mesh: Mesh | None = None, target_shardings: Any = None, state_shardings: dict | None = None):
    """(train_step(state, target_params, batch) -> (state, metrics), eval_step(params, target_params, batch)
    -> metrics), jitted; sharded over `mesh` when given (`state_shardings`: the train state's, by default
    replicated)."""

    def loss_fn(params, target_params, batch):
        with nn.logical_axis_rules(LOGICAL_RULES):
            target_out = target_forward(model, target_params, batch)
            # Pinned here, so that the drafter's shardings do not propagate back into the target's forward.
            target_out = target_out.replace(
                hidden=nn.with_logical_constraint(target_out.hidden, ("batch", "length", "embed")),
                logits=nn.with_logical_constraint(target_out.logits, ("batch", "length", "vocab")))
        return drafter.loss(params, Target(model.config, target_params), batch, target_out)

    def train_step(state, target_params, batch):
        # Training-time randomness for the losses that use it (Hydra's embedding noise); eval gets none.
        batch = batch | {"rng": jax.random.fold_in(jax.random.key(0), state["step"])}
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], target_params, batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = metrics | {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    def eval_step(params, target_params, batch):
        loss, metrics = loss_fn(params, target_params, batch)
        return metrics | {"loss": loss}

    if mesh is None:
        return jax.jit(train_step, donate_argnums=0), jax.jit(eval_step)
    replicated = NamedSharding(mesh, PartitionSpec())
    state = state_shardings or replicated
    params = replicated if state_shardings is None else state_shardings["params"]
    batch_spec = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    train = jax.jit(train_step, in_shardings=(state, target_shardings, batch_spec),
                    out_shardings=(state, replicated), donate_argnums=0)
    evaluate = jax.jit(eval_step, in_shardings=(params, target_shardings, batch_spec), out_shardings=replicated)

    def in_mesh(fn):
        def run(state_or_params, target_params, local_batch):
            # Each process holds its own slice of the global batch (grain shards by process).
            batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(batch_spec, np.asarray(x)),
                                 local_batch)
            with jax.set_mesh(mesh):
                return fn(state_or_params, target_params, batch)
        return run

    return in_mesh(train), in_mesh(evaluate)
