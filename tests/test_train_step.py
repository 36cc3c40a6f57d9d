"""The train step's gradient accumulation: a batch run as microbatches gives the whole batch's update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from amphista_jax.drafters import VARIANTS
from amphista_jax.engine.sharding import make_mesh, param_shardings, train_state_shardings
from amphista_jax.models.config import tiny_llama_config
from amphista_jax.models.llama import Transformer, init_params
from amphista_jax.models.target import Target
from amphista_jax.train.optim import OptimConfig, make_optimizer
from amphista_jax.train.step import make_steps
from tests.helpers import default_cases

CONFIG = tiny_llama_config(vocab_size=256)


@pytest.mark.parametrize("method,sharded,masked", [
    ("medusa", False, False), ("amphista", False, False), ("medusa", False, True), ("medusa", True, True),
    pytest.param("medusa", True, False, marks=pytest.mark.slow),
    pytest.param("amphista", True, False, marks=pytest.mark.slow),
    pytest.param("amphista", True, True, marks=pytest.mark.slow)],  # ~2.5 minutes on 2 cores
    ids=["medusa", "amphista", "medusa-masked", "medusa-sharded-masked", "medusa-sharded", "amphista-sharded",
         "amphista-sharded-masked"])
# Accumulation is method-independent (train.step); Amphista's and the unmasked cases run under -m slow.
@default_cases('medusa-sharded-masked')
def test_microbatches_give_the_whole_batchs_update(method, sharded, masked):
    """4 slices weighted by their loss tokens give the whole batch's mean loss: the same metrics, gradients and
    updated params (to fp32 rounding), one device or sharded over (data=2, fsdp=2, tensor=2). `masked`: rows 0, 4
    and 1 are not trained, so slice 0 has no loss token and slice 1 half of the others' (an unweighted mean of the
    slices would differ)."""
    params = init_params(CONFIG, jax.random.key(0))
    drafter = VARIANTS[method]
    optimizer = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=1), 10)
    tokens = np.asarray(jax.random.randint(jax.random.key(7), (8, 16), 0, 256), np.int32)
    loss_mask = np.ones_like(tokens)
    if masked:
        loss_mask[[0, 4, 1]] = 0
    batch = {"tokens": tokens, "loss_mask": loss_mask}
    mesh = make_mesh(data=2, fsdp=2, tensor=2) if sharded else None
    shardings = param_shardings(CONFIG, mesh) if sharded else None
    state_shardings = train_state_shardings(drafter, Target(CONFIG, params), optimizer, mesh) if sharded else None
    if sharded:
        params = jax.device_put(params, shardings)

    def run(microbatches: int):
        draft = drafter.init(jax.random.key(1), Target(CONFIG, params))
        state = {"params": draft, "opt_state": optimizer.init(draft), "step": jnp.zeros((), jnp.int32)}
        if sharded:
            state = jax.device_put(state, state_shardings)
        step, evaluate = make_steps(Transformer(CONFIG), drafter, optimizer, mesh, shardings, state_shardings,
                                    microbatches)
        new, metrics = step(state, params, batch)
        return new["params"], metrics, evaluate(new["params"], params, batch)

    whole, split = run(1), run(4)
    for a, b in zip(whole, split, strict=True):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6),
                     a, b)
    assert float(whole[1]["loss"]) > 0
