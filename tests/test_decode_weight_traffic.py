"""No per-step weight traffic but the products' read: the compiled decode loop (split layout, decoding's) moves no
weight into a buffer of its own per step, AR and speculative alike; the stacked layout (training's) does, one copy of
each layer's slice of each weight per step, which the check finds (so it can fail). Read from the optimized HLO on
CPU (`evals/benchmarks/decode_profile.weight_moves`); no weights are read, programs are compiled from shapes."""

from __future__ import annotations

import pytest

from amphista_jax.assets import default_model_dir
from amphista_jax.drafters import Eagle3, Medusa
from amphista_jax.evals.benchmarks.decode_profile import decode_program, weight_moves
from amphista_jax.models.hf import load_config
from amphista_jax.models.llama import param_shapes
from amphista_jax.trees.names import get_tree

CONFIG = load_config(default_model_dir())


@pytest.mark.parametrize("drafter, tree", [(None, None), (Medusa(num_heads=3), "chain-3"), (Eagle3(), "chain-3")],
                         ids=["ar", "medusa", "eagle3"])
def test_the_split_decode_loop_moves_no_weight_per_step(drafter, tree):
    params, _ = param_shapes(CONFIG, split=True)
    hlo = decode_program(CONFIG, params, 1, 128, drafter, get_tree(tree) if tree else None)
    assert weight_moves(hlo, CONFIG.num_layers) == []


def test_the_stacked_loop_copies_each_layers_weights_per_step_and_the_check_sees_it():
    params, _ = param_shapes(CONFIG, split=False)
    moved = weight_moves(decode_program(CONFIG, params, 1, 128), CONFIG.num_layers)
    matrices = {w.rsplit("/", 2)[-2] for w, _, _ in moved}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= matrices, moved
